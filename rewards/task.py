"""The task seam: what every data source yields and how its trajectories are verified (pure Python).

A *task* is one dataset of a recipe: the procedural domains (rewards/arithmetic.py, rewards/domains.py),
the long-tail benchmark task, and any task a user writes (named in the recipe by `type: custom`,
rewards/config.py). The driver reaches a task only through `Task`: it draws `Problem`s from
`train_stream`, evaluates on `heldout()`, renders `Problem.prompt` (text, or chat messages) with the
tokenizer, and hands each finished `Trajectory` to `verify`, which returns a `Verdict`. Nothing outside a
task reads `Problem.metadata`: that is the task's own data (operands, a worked solution, a test suite).

`verify(trajectory, ctx)` gets a `VerifyContext` with what rl/ injects, for instance a `CodeRunner` for
tasks whose answers must be executed; rewards/ never imports the sandbox client that implements it.

Writing a task: subclass `Task` (its optional methods then have defaults) or implement every method;
`rl validate` checks a `custom` task against this protocol. A trajectory has one assistant turn today;
tool turns (role "tool") come with agentic rollouts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class Message:
    """One chat message of a prompt."""

    role: Role
    content: str


@dataclass(frozen=True)
class Problem:
    """One prompt of a task with its reference."""

    problem_id: str
    """Unique within its dataset, stable across runs (splits, seeds and the store key on it)."""
    dataset: str
    """The name of the dataset (task) that made it."""
    prompt: str | tuple[Message, ...]
    """The prompt as text, or as chat messages that the tokenizer's chat template renders."""
    answer: str = ""
    """Reference answer (what the verifier compares against; may be empty)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The task's own JSON-able data (operands, a worked solution, tests); read only by the task."""

    def to_record(self) -> dict:
        """A JSON-able dict (checkpoints, Ray); `from_record` inverts it."""
        prompt = self.prompt if isinstance(self.prompt, str) else [{"role": m.role, "content": m.content} for m in self.prompt]
        return {"problem_id": self.problem_id, "dataset": self.dataset, "prompt": prompt, "answer": self.answer,
                "metadata": dict(self.metadata)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "Problem":
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            prompt = tuple(Message(m["role"], m["content"]) for m in prompt)
        return cls(record["problem_id"], record["dataset"], prompt, record.get("answer", ""), dict(record.get("metadata", {})))


@dataclass(frozen=True)
class Turn:
    """One turn of a trajectory after the prompt: the policy's text ("assistant") or a tool's output ("tool")."""

    role: Literal["assistant", "tool"]
    text: str


@dataclass(frozen=True)
class Trajectory:
    """What the verifier sees of one finished sample."""

    problem: Problem
    turns: tuple[Turn, ...]
    finish_reason: str = "eos"
    """'eos' (the policy ended it) or 'length' (cut at the token budget)."""

    @classmethod
    def single(cls, problem: Problem, response: str, finish_reason: str = "eos") -> "Trajectory":
        """A one-turn trajectory: the policy's response to the prompt."""
        return cls(problem, (Turn("assistant", response),), finish_reason)

    @property
    def response(self) -> str:
        """The policy's last turn (what a single-answer verifier reads); "" when it wrote nothing."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one trajectory."""

    reward: float
    """Task reward (the trainer may add shaping terms such as the effort length penalty)."""
    correct: bool
    """Whether the answer is right (accuracy metrics count this)."""
    reason: str = ""
    """Why, in a few words (e.g. "answer 92, expected 961"); stored with the sample."""
    answered: bool | None = None
    """Whether a final answer could be read from the response at all, right or wrong (None: the verifier
    does not say). Held-out evaluation reports its share, so a gain in accuracy can be told apart from
    a gain in answer format."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of running code through a `CodeRunner`."""

    exit_code: int | None
    """None when the run was killed (timeout, resource limit)."""
    stdout: str
    stderr: str
    timed_out: bool = False


@runtime_checkable
class CodeRunner(Protocol):
    """Runs untrusted code in isolation for a verifier (implemented outside rewards/: the sandbox client)."""

    def run(self, code: str, *, stdin: str = "", timeout_s: float = 10.0) -> ExecResult: ...


@dataclass(frozen=True)
class VerifyContext:
    """What rl/ hands a verifier besides the trajectory."""

    code: CodeRunner | None = None
    """Code execution for tasks that must run the answer; None where the job has no sandbox."""


@runtime_checkable
class Task(Protocol):
    """One dataset: a problem source, its held-out split and its verifier.

    Subclass it to inherit the defaults of the optional methods (`demonstration`, `reasoning`,
    `response_budget`, `scan`); `train_stream`, `heldout` and `verify` are the task's own.
    """

    name: str
    """The dataset name (tags prompts, samples and metrics)."""

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        """Infinite train problems, reproducible per seed_offset (distinct offsets: distinct streams),
        never yielding a held-out problem."""
        ...

    def heldout(self) -> Sequence[Problem]:
        """The fixed held-out split, in a fixed order (evaluation)."""
        ...

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        """Judge one trajectory. Should not raise; if it does, the sample gets reward 0 and the error as its reason."""
        ...

    def demonstration(self, problem: Problem, rng: random.Random, *, direct_answer_rate: float | None = None,
                      reasoning_frac: float | None = None) -> "str | tuple[Turn, ...]":
        """SFT target for `problem`: the response text, or (tool use) the turns after the prompt, assistant and
        tool in order, which the SFT stage tokenises as a rollout holds them (tool outputs as the worker appends
        them, not trained; rl/algo/sft.py). `direct_answer_rate` / `reasoning_frac`: the effort cold start's
        shorter demonstrations (seed §5.1.4; see rl/config.py SFTStage). Tasks without demonstrations
        cannot be used in an SFT stage."""
        raise NotImplementedError(f"task {self.name!r} has no demonstrations: it cannot be used in an SFT stage")

    def reasoning(self, response: str) -> str:
        """The part of a response that counts as reasoning, ℓ in the effort length penalty (seed §5.1.4);
        default: all of it."""
        return response

    def response_budget(self, problem: Problem, j: int) -> int | None:
        """A forced length for sample j of the problem's group (system benchmarks); None: stop at EOS."""
        return None

    def scan(self, *, need_train: bool = True) -> str | None:
        """Check all of the task's data before the job starts any worker (the job calls it when the task has
        it): raise a `DatasetError` (rewards/dataset_io.py: one line naming the file, row and field; `rl train`
        prints it and exits 2); return a one-line summary for the console, or None. Default: nothing to check.
        `rl eval` passes need_train=False (only held-out problems are needed) when the method takes it."""
        return None


TASK_METHODS = ("train_stream", "heldout", "verify", "demonstration", "reasoning", "response_budget")
"""The methods a task must have (a `Task` subclass inherits the optional ones)."""


def missing_task_methods(obj: object) -> list[str]:
    """Methods of the `Task` protocol that `obj` (a class or an instance) lacks, in protocol order."""
    return [m for m in TASK_METHODS if not callable(getattr(obj, m, None))]
