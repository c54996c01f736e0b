"""A system-benchmark task with a long-tail response-length distribution (forced-length mode).

Every sample (not every prompt: the members of one group differ in length too) gets a response
length drawn from a log-normal distribution, median `median_tokens`, log-std `sigma`
(p99/p50 = exp(2.326·sigma): 10.2 at sigma = 1), clipped to [1, max_tokens]. The engine ends the
response at exactly that many tokens (EOS ignored), which isolates the system from what the policy
has learned. The reward is a deterministic pseudo-random bit of the response text,
so GRPO groups have non-zero advantages and the train step does real work.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from configbase import StrictConfig
from rewards.task import Problem, Task, Trajectory, Verdict, VerifyContext


class LongTailConfig(StrictConfig):
    """Forced-length prompts with log-normal response lengths, for dispatch benchmarks."""

    type: Literal["longtail"] = "longtail"
    """Discriminator: the long-tail system-benchmark task."""
    name: str = Field("longtail", min_length=1)
    """Dataset name."""
    median_tokens: int = Field(16, gt=0)
    """Median response length in tokens."""
    sigma: float = Field(1.0, ge=0)
    """Log-std of the length distribution; p99/p50 = exp(2.326·sigma)."""
    max_tokens: int = Field(256, gt=0)
    """Lengths are clipped to at most this many tokens."""
    seed: int = 0
    """Seed of the length draws."""
    num_heldout: int = Field(16, gt=0)
    """Problems in the (meaningless) held-out set, so evaluation has something to run."""
    mode: Literal["budget", "eos"] = "budget"
    """How a sample is held to its drawn length. budget: the request's max_new_tokens is the length (EOS ignored), so
    the engine knows every sample's length when it admits it. eos: max_new_tokens is the run's cap and the response
    ends at the drawn length as if the policy had sampled EOS there (`GenerationRequest.eos_at`), which the engine
    learns only when it happens, as with a real policy: the long-tail memory benchmark (bench/long_tail.py)."""
    prompt_tokens: int | None = Field(None, gt=2)
    """Pad every prompt to this many characters (tokens under the char tokenizer); None: short prompts ("17:")."""

    def build(self) -> "LongTailTask":
        return LongTailTask(self)


class LongTailTask(Task):
    def __init__(self, cfg: LongTailConfig):
        self.cfg = cfg
        self.name = cfg.name

    @property
    def forced_length(self) -> str:
        """`LongTailConfig.mode`: how the controller holds a sample to `response_budget` (rl/algo/async_grpo.py)."""
        return self.cfg.mode

    def _problem(self, i: int, rng: random.Random) -> Problem:
        c = self.cfg
        text = f"{i % 1000}:"
        if c.prompt_tokens is not None:  # digits of the problem's number repeated, then the colon
            text = (str(i % 1000) * c.prompt_tokens)[:c.prompt_tokens - 1] + ":"
        return Problem(f"{c.name}:{i}", c.name, text, metadata={"length_seed": rng.randrange(1 << 30)})

    def response_budget(self, problem: Problem, j: int) -> int:
        """Forced length of sample j of this problem's group (a log-normal draw)."""
        c = self.cfg
        z = random.Random(f"{problem.metadata['length_seed']}:{j}").gauss(0.0, 1.0)
        return max(1, min(c.max_tokens, round(math.exp(math.log(c.median_tokens) + c.sigma * z))))

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        rng = random.Random(f"{self.cfg.seed}:{seed_offset}")
        i = 0
        while True:
            yield self._problem(i, rng)
            i += 1

    def heldout(self) -> list[Problem]:
        rng = random.Random(f"{self.cfg.seed}:heldout")
        return [self._problem(-1 - i, rng) for i in range(self.cfg.num_heldout)]

    def demonstration(self, problem: Problem, rng: random.Random, *, direct_answer_rate: float | None = None,
                      reasoning_frac: float | None = None) -> str:
        return "x" * self.response_budget(problem, rng.randrange(1 << 30))

    def verify(self, trajectory: Trajectory, ctx: VerifyContext | None = None) -> Verdict:
        bit = hashlib.blake2b(trajectory.response.encode(), digest_size=1).digest()[0] & 1
        return Verdict(float(bit), bool(bit), "pseudo-random bit of the response")
