"""Records that flow through the driver (immutable; the store maps them to tables separately).

Shape suffixes on ragged lists: `_T` per response token.

Multi-turn samples (tool calls, issue #16): `Sample.turns` splits the response tokens into model turns
(sampled, trained) and tool turns (the tokens appended after a call: end of the model's turn, the tool's
output, the next turn's header; loss mask 0, placeholder logprobs). No turns: one model turn, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """One dispatched prompt; its group is `group_size` samples that share it (GRPO)."""

    prompt_id: str
    dataset: str
    text: str
    """Prompt text exactly as tokenised (chat formatting already applied)."""
    tokens: tuple[int, ...]
    answer: str
    """Reference answer, for the verifier."""
    group_size: int
    policy_version: int
    """Policy version at dispatch."""
    config_version: int = 0
    """Live-config version at dispatch (rl/reconfigure.py)."""


ToolStatus = Literal["ok", "error", "timeout", "sandbox_failed", "parse_error"]
"""How a tool call ended: ok (exit 0), error (the code failed or hit a memory/process/output limit), timeout
(wall clock or CPU time), sandbox_failed (the sandbox crashed or was never admitted), parse_error (the
model's call was malformed, named an unknown tool or broke its schema; nothing ran)."""


@dataclass(frozen=True)
class Turn:
    """One span of a sample's response tokens, [start, end)."""

    kind: Literal["model", "tool"]
    start: int
    end: int
    text: str = ""
    """model: the turn's text as decoded; tool: the output as the model saw it (truncated and marked)."""
    tool: str | None = None
    """Tool turns: the tool called (None when the call did not parse to a declared tool)."""
    call: str | None = None
    """Tool turns: the call, as JSON of name and arguments (hermes) or the code (code format)."""
    status: ToolStatus | None = None
    exit_code: int | None = None
    truncated: bool = False
    """Tool turns: the output passed the recipe's max_tool_output_tokens and was cut."""
    wall_s: float | None = None
    """Tool turns: seconds from the call's parse to its output (sandbox create, exec and admission waits)."""


@dataclass(frozen=True)
class Sample:
    """One finished trajectory with its provenance and reward."""

    sample_id: str
    prompt_id: str
    dataset: str
    group_id: str
    """Advantages are computed within a group (here: the prompt)."""
    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    prompt_text: str
    response_text: str
    behavior_logprobs_T: tuple[float, ...]
    """Log-probability of each response token under the policy that sampled it."""
    policy_versions_T: tuple[int, ...]
    """Policy version that generated each response token."""
    reward: float
    correct: bool
    finish_reason: str
    """'eos' or 'length'."""
    status: Literal["finished", "discarded"] = "finished"
    """finished, or discarded (its group was dropped at warm-up, seed §5.2.2): stored, never trained."""
    timings: dict[str, float] = field(default_factory=dict)
    """Wall-clock seconds: 'dispatched_at', 'finished_at' (epoch), 'generate_s'."""
    teacher: str | None = None
    """OPD: the teacher that scores this sample (its dataset's teacher at dispatch, or the new one if
    that teacher was removed before training)."""
    config_version: int = 0
    """Live-config version the sample was dispatched under."""
    routing_trace: np.ndarray | None = None
    """MoE only: int16 [prompt_len + response_len - 1, num_layers, top_k], the experts chosen for
    every token fed to the model (the last sampled token is never fed), concatenated over segments."""
    effort: int | None = None
    """Effort control (seed §5.1.4): the reasoning-effort level b the prompt carried; None without."""
    reason: str = ""
    """Why the verifier scored it so (rewards.task.Verdict.reason)."""
    turns: tuple[Turn, ...] = ()
    """Multi-turn samples: the model and tool turns, in order, tiling the response; () for one model turn."""
    failure: str | None = None
    """Repercussion (seed §5.1.3, rl/algo/repercussion.py): why a tool call's sandbox failed and ended the sample
    (timeout, cpu, memory, processes, output_truncated, crashed, refused, sandbox_error); None: no failure."""

    def __post_init__(self) -> None:
        n, at = len(self.response_tokens), 0
        for i, t in enumerate(self.turns):  # a worker bug here would train on tool output: refuse it at once
            if t.start != at or t.end < t.start or t.end > n:
                raise ValueError(f"sample {self.sample_id}: turn {i} [{t.start}, {t.end}) does not continue at {at} "
                                 f"within {n} response tokens")
            at = t.end
        if self.turns and at != n:
            raise ValueError(f"sample {self.sample_id}: turns end at {at}, the response has {n} tokens")

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_tokens)

    @property
    def num_trained_tokens(self) -> int:
        """Response tokens the loss counts: all but tool-output ones."""
        return sum(self.loss_mask_T()) if self.turns else len(self.response_tokens)

    def loss_mask_T(self) -> tuple[int, ...]:
        """1 for each response token the policy sampled (trained), 0 for tool-turn tokens (appended, not sampled)."""
        mask = [1] * len(self.response_tokens)
        for t in self.turns:
            if t.kind == "tool":
                mask[t.start : t.end] = [0] * (t.end - t.start)
        return tuple(mask)
