"""Shared machinery of the procedural task families (addition, rewards/arithmetic.py, and the ten domains
of rewards/domains.py): seeded train streams, a hash-based held-out split, worked demonstrations and
last-line verification. A family supplies `draw` and `render`. Pure Python.

Format shared by every family. The prompt ends with "=" (the driver adds BOS); the response is zero or
more worked lines, then one answer line, no trailing newline (the driver appends EOS). The verifier
compares the response's last non-blank line with the answer, exactly.

Splits. An instance is held out iff blake2b(split key) % 10 == 0 (`in_heldout_split`): the train
stream rejects held-out instances and the held-out set draws only them, so the two never share an
instance, whatever the seeds. Both are `random.Random` streams seeded from the config: same seed, same
problems.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from typing import Any, ClassVar

from rewards.dataset_io import DatasetError
from rewards.task import Problem, Task, Trajectory, Verdict, VerifyContext

HELDOUT_MODULUS = 10
"""An instance is held out iff its split key hashes to 0 modulo this: a fixed 10% of every family."""
_MAX_DRAWS_PER_HELDOUT = 1000
"""Held-out draws give up after this many attempts per wanted problem (a too-small instance space)."""


def stable_int(text: str) -> int:
    """A process-independent hash (Python's hash() is salted per process; splits and seeds must survive restarts)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def in_heldout_split(key: str) -> bool:
    """The split rule of every procedural family: the instance with this split key is held out."""
    return stable_int(key) % HELDOUT_MODULUS == 0


def partial_scratchpad(worked: str, reasoning_frac: float) -> str:
    """The first round-half-up(reasoning_frac · n) of a worked solution's n lines, then its answer line."""
    *lines, answer = worked.split("\n")
    keep = min(len(lines), math.floor(reasoning_frac * len(lines) + 0.5))
    return "\n".join([*lines[:keep], answer])


def last_line_verdict(response: str, answer: str, *, numeric: bool = False) -> Verdict:
    """Reward 1 iff the last non-blank line of `response` is exactly `answer`; never raises.
    numeric: a last line that is not a plain number is reported as such."""
    text = response.strip() if isinstance(response, str) else ""
    if not text:
        return Verdict(0.0, False, "empty response", answered=False)
    last = text.splitlines()[-1].strip()
    if numeric and not (last.isascii() and last.isdigit()):
        return Verdict(0.0, False, f"last line {last[:40]!r} is not a number", answered=False)
    if last == answer:
        return Verdict(1.0, True, f"answer {last}", answered=True)
    return Verdict(0.0, False, f"answer {last[:40]}, expected {answer}", answered=True)


class ProceduralTask(Task):
    """A procedural family: `draw(rng)` an instance, `render(instance)` it to (prompt, worked lines,
    answer, metadata). Streams, splits, demonstrations, verification and ℓ are shared."""

    kind: ClassVar[str]
    """The config's `type` discriminator; it salts the split hash and the streams."""

    def __init__(self, cfg: Any):
        if cfg.type != self.kind:
            raise ValueError(f"{type(self).__name__} builds `type: {self.kind}` datasets, got `type: {cfg.type}`")
        self.cfg = cfg
        self.name = cfg.name
        self._heldout: list[Problem] | None = None

    # -- what a family defines --------------------------------------------------------------------
    def draw(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def render(self, instance: Any) -> tuple[str, list[str], str, dict]:
        """(prompt, worked lines, answer, metadata) of an instance."""
        raise NotImplementedError

    def split_key(self, problem: Problem) -> str:
        """What the held-out hash reads: the family and the prompt (the prompt determines the instance)."""
        return f"{self.kind}:{problem.prompt}"

    stream_salt: ClassVar[str | None] = None
    """Salt of the stream seeds; None: the family's `kind`."""

    # -- shared -----------------------------------------------------------------------------------
    def make_problem(self, instance: Any) -> Problem:
        prompt, lines, answer, metadata = self.render(instance)
        return Problem(problem_id=f"{self.cfg.name}:{prompt[:-1]}", dataset=self.cfg.name, prompt=prompt,
                       answer=answer, metadata={**metadata, "solution": "\n".join([*lines, answer])})

    def _salt(self) -> str:
        return f"{self.kind}:" if self.stream_salt is None else self.stream_salt

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        """Infinite train problems (repeats possible, held-out instances never); reproducible per
        (cfg.seed, seed_offset), and distinct offsets give distinct streams."""
        rng = random.Random(stable_int(f"train:{self._salt()}{self.cfg.seed}:{seed_offset}"))
        while True:
            problem = self.make_problem(self.draw(rng))
            if not in_heldout_split(self.split_key(problem)):
                yield problem

    def heldout(self) -> list[Problem]:
        """cfg.num_heldout distinct held-out problems, fixed given cfg.seed, in draw order."""
        if self._heldout is None:
            cfg = self.cfg
            rng = random.Random(stable_int(f"heldout:{self._salt()}{cfg.seed}"))
            seen: set[str] = set()
            problems: list[Problem] = []
            for _ in range(_MAX_DRAWS_PER_HELDOUT * cfg.num_heldout):
                problem = self.make_problem(self.draw(rng))
                key = self.split_key(problem)
                if key in seen or not in_heldout_split(key):
                    continue
                seen.add(key)
                problems.append(problem)
                if len(problems) == cfg.num_heldout:
                    break
            else:
                raise DatasetError(f"dataset {cfg.name!r} (type {self.kind})",
                                   f"found only {len(problems)} distinct held-out instances of num_heldout="
                                   f"{cfg.num_heldout}: the instance space is too small; lower num_heldout")
            self._heldout = problems
        return list(self._heldout)

    def scan(self) -> None:
        """What a job checks before anything starts (rl/algo/job.py `open_job`; `rl validate` too): that the held-out
        set can be drawn. A space too small for num_heldout is one line (a DatasetError), not a crash at the
        first evaluation after a stage of training."""
        self.heldout()

    def reasoning(self, response: str) -> str:
        """ℓ for the length penalty: the scratchpad, every character before the final answer line (newlines
        included); a direct answer has none."""
        cut = response.rstrip().rfind("\n")
        return response[: cut + 1] if cut >= 0 else ""

    def worked_demonstration(self, problem: Problem, rng: random.Random) -> str:
        """The worked solution a demonstration starts from (a family may add slips)."""
        return problem.metadata["solution"]

    def demonstration(self, problem: Problem, rng: random.Random, *, direct_answer_rate: float | None = None,
                      reasoning_frac: float | None = None) -> str:
        """SFT target: the worked solution; with probability direct_answer_rate (default
        cfg.direct_answer_rate) the answer line alone; reasoning_frac keeps that share of the worked
        lines (`partial_scratchpad`: the least significant steps, which the rest depend on)."""
        worked = self.worked_demonstration(problem, rng)
        if reasoning_frac is not None:
            return partial_scratchpad(worked, reasoning_frac)
        direct = self.cfg.direct_answer_rate if direct_answer_rate is None else direct_answer_rate
        if direct and rng.random() < direct:
            return worked.rsplit("\n", 1)[-1]  # the answer line alone (slips included)
        return worked

    def verify(self, trajectory: Trajectory, ctx: VerifyContext | None = None) -> Verdict:
        """Reward 1 iff the response's last non-blank line is exactly the answer; never raises."""
        return last_line_verdict(trajectory.response, trajectory.problem.answer)


class DrawnTask(Task):
    """A task whose problems are drawn at random and split by a fixed hash (rewards/compute.py, rewards/extract.py):
    `_draw(rng)` makes a problem, `_split_key(problem)` names what the held-out split reads (the same key in every
    dataset of the family, so none trains on another's held-out problems). Subclasses set `family`, `name`, `seed`
    and `num_heldout`."""

    family: ClassVar[str]
    name: str
    seed: int
    num_heldout: int
    _heldout: list[Problem] | None = None

    def _draw(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def _split_key(self, problem: Problem) -> str:
        raise NotImplementedError

    def _held(self, problem: Problem) -> bool:
        return in_heldout_split(f"{self.family}:{self._split_key(problem)}")

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        """Infinite train problems, reproducible per (seed, seed_offset), never a held-out one."""
        rng = random.Random(stable_int(f"{self.family}:train:{self.seed}:{seed_offset}"))
        while True:
            p = self._draw(rng)
            if not self._held(p):
                yield p

    def heldout(self) -> list[Problem]:
        """num_heldout distinct held-out problems, fixed given the seed, in draw order."""
        if self._heldout is None:
            rng = random.Random(stable_int(f"{self.family}:heldout:{self.seed}"))
            out: dict[str, Problem] = {}
            for _ in range(_MAX_DRAWS_PER_HELDOUT * self.num_heldout):
                p = self._draw(rng)
                if self._held(p):
                    out.setdefault(p.problem_id, p)
                    if len(out) == self.num_heldout:
                        break
            else:
                raise ValueError(f"{self.family} {self.name!r}: only {len(out)} distinct held-out problems of "
                                 f"num_heldout={self.num_heldout}")
            self._heldout = list(out.values())
        return list(self._heldout)

    def scan(self) -> None:
        """The held-out set can be drawn (a space too small is one line before the job starts)."""
        self.heldout()
