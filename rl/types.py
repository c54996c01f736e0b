"""Records that flow through the driver (immutable; the store maps them to tables separately).

Shape suffixes on ragged lists: `_T` per response token.
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

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_tokens)
