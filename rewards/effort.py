"""Effort conditioning (seed §5.1.4, Appendix C). Pure Python.

The prompt is prefixed with exactly `Reasoning Effort: {b} (range 1--100; higher values request more
thorough reasoning)`; each prompt is sampled `samples_per_level` times at every training level b, the
responses sharing (prompt, b) form a subgroup whose rewards are mean-centred on their own, and the
reward adds a length term that depends on b:

    r_len(b, ℓ) = −min(C_max, k(b) · ℓ / L_norm),    k(b) = k0 · exp(−(b − b_min) / τ),
    τ = λ · mean spacing of the training levels,

with ℓ the response's reasoning tokens (the tokens of what a task's `reasoning` returns) and b_min the lowest
training level. Raising b by τ multiplies the penalty coefficient by 1/e.
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from configbase import StrictConfig
from rewards.task import Message

EFFORT_PREFIX = "Reasoning Effort: {effort} (range 1--100; higher values request more thorough reasoning)"


def effort_prefix(effort: int) -> str:
    return EFFORT_PREFIX.format(effort=effort)


def with_effort(prompt: str | tuple[Message, ...], effort: int | None) -> str | tuple[Message, ...]:
    """The prompt as the policy sees it (None: as is). Text: the effort prefix line, then the task prompt.
    Chat messages: the system prompt is prefixed with that line (seed §5.1.4), a system message holding
    only the line is added when there is none."""
    if effort is None:
        return prompt
    if isinstance(prompt, str):
        return f"{effort_prefix(effort)}\n{prompt}"
    if prompt and prompt[0].role == "system":
        return (Message("system", f"{effort_prefix(effort)}\n{prompt[0].content}"), *prompt[1:])
    return (Message("system", effort_prefix(effort)), *prompt)


class EffortConfig(StrictConfig):
    """Train one policy at several reasoning-effort levels with an effort-dependent length penalty."""

    levels: list[int] = Field(min_length=1)
    """Training effort levels b, each in 1..100."""
    samples_per_level: int = Field(4, gt=0)
    """M_b: samples per prompt at each level; a prompt's group is len(levels) × this."""
    k0: float = Field(1.0, ge=0)
    """Base penalty coefficient k0 (the penalty at b = b_min per L_norm reasoning tokens)."""
    lam: float = Field(1.0, gt=0)
    """λ: τ = λ · mean spacing of the levels; smaller separates the levels' behaviour more."""
    c_max: float = Field(0.5, ge=0)
    """C_max: the largest deduction a response can get."""
    l_norm: float = Field(64.0, gt=0)
    """L_norm: reference length in reasoning tokens."""

    @field_validator("levels")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        bad = [b for b in v if not 1 <= b <= 100]
        if bad:
            raise ValueError(f"effort levels must be in 1..100, got {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"effort levels must be distinct, got {v}")
        return sorted(v)

    @property
    def group_size(self) -> int:
        return len(self.levels) * self.samples_per_level

    @property
    def tau(self) -> float:
        """λ · mean spacing of the training levels (infinite with a single level: no decay)."""
        if len(self.levels) < 2:
            return math.inf
        return self.lam * (self.levels[-1] - self.levels[0]) / (len(self.levels) - 1)

    def coefficient(self, effort: int) -> float:
        """k(b) = k0 · exp(−(b − b_min) / τ)."""
        return self.k0 * math.exp(-(effort - self.levels[0]) / self.tau)

    def length_penalty(self, effort: int, reasoning_tokens: int) -> float:
        """r_len = −min(C_max, k(b) · ℓ / L_norm)."""
        return -min(self.c_max, self.coefficient(effort) * reasoning_tokens / self.l_norm)
