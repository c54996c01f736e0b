"""Reward/task configuration: pure pydantic, no torch, so recipes validate instantly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from model.config import StrictConfig

if TYPE_CHECKING:
    from rewards.arithmetic import ArithmeticTask


class ArithmeticConfig(StrictConfig):
    """Procedural multi-digit addition with a column-by-column scratchpad (see rewards/arithmetic.py)."""

    type: Literal["arithmetic"] = "arithmetic"
    """Discriminator: the procedural addition task family."""
    name: str = Field("arith", min_length=1)
    """Dataset name; it prefixes every problem_id and tags samples and metrics."""
    min_digits: int = Field(1, ge=1)
    """Fewest decimal digits of an operand (each operand's length is drawn uniformly, independently)."""
    max_digits: int = Field(6, ge=1, le=18)
    """Most decimal digits of an operand; 18 keeps a+b well inside int64 for any consumer that needs it."""
    pair_nine_prob: float = Field(0.3, ge=0.0, le=1.0)
    """Probability that a column where both operands have a digit is forced to sum to 9, making cascading
    carries (the columns demonstrators slip on) common; with uniform digits they are rare."""
    slip_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability, per cascading column, that an SFT demonstration drops the carry ("4+5+1=9");
    never applies to the clean solution or to the verifier."""
    direct_answer_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of SFT demonstrations that skip the scratchpad and write only the answer line, so the
    policy can trade length for accuracy (effort conditioning needs that choice to exist)."""
    seed: int = 0
    """Seed of the train stream and of the held-out set; same seed, same problems."""
    num_heldout: int = Field(256, gt=0)
    """Size of the fixed held-out set (distinct (a, b) pairs never seen by the train stream)."""

    @model_validator(mode="after")
    def _digit_range(self) -> "ArithmeticConfig":
        if self.max_digits < self.min_digits:
            raise ValueError(f"max_digits={self.max_digits} is smaller than min_digits={self.min_digits}")
        return self

    def build(self) -> "ArithmeticTask":
        from rewards.arithmetic import ArithmeticTask

        return ArithmeticTask(self)
