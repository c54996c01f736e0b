"""Dataset configs: one strict config per task family, chosen in a recipe by `type`; `build()` returns
the `rewards.task.Task`. Pure Python (no torch), so recipes validate instantly.

`type: jsonl | parquet | hf_disk` reads problems from a file (rewards/datasets.py, verifiers in
rewards/verifiers.py). `type: custom` names a task class of the user's (`task: "package.module:Class"`, constructed as
`Class(name=..., **args)`); validating the recipe imports it and checks it against the `Task` protocol.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from configbase import StrictConfig
from rewards.arithmetic import ArithmeticConfig
from rewards.datasets import FILE_DATASET_CONFIGS
from rewards.domains import DOMAIN_CLASSES
from rewards.longtail import LongTailConfig
from rewards.task import Task, missing_task_methods


# ---- procedural domains (rewards/domains.py) ---------------------------------------------------
# One strict config per domain, each with its `type` discriminator, so a recipe's dataset list is a
# discriminated union (`DomainConfig` below). Every default keeps prompt + worked solution within
# 60 characters so a tiny char-level model learns the domain on CPU in a minute or two.


class _ProceduralConfig(StrictConfig):
    """Fields every procedural domain shares (not a recipe type itself: it has no discriminator)."""

    seed: int = 0
    """Seed of the train stream and of the held-out set; same seed, same problems."""
    num_heldout: int = Field(64, gt=0)
    """Size of the fixed held-out set (distinct instances the train stream never yields)."""
    direct_answer_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of SFT demonstrations that skip the worked lines and write only the answer line."""

    def build(self) -> Task:
        return DOMAIN_CLASSES[self.type](self)


class _StringLengthConfig(_ProceduralConfig):
    min_len: int = Field(3, ge=1)
    """Shortest input string."""
    max_len: int = Field(8, ge=1, le=24)
    """Longest input string (24 keeps prompt + response within ~60 characters)."""

    @model_validator(mode="after")
    def _len_range(self):
        if self.max_len < self.min_len:
            raise ValueError(f"max_len={self.max_len} is smaller than min_len={self.min_len}")
        return self


class _DigitsConfig(_ProceduralConfig):
    min_digits: int = Field(1, ge=1)
    """Fewest decimal digits of the (first) operand, drawn uniformly."""
    max_digits: int = Field(3, ge=1, le=6)
    """Most decimal digits of the (first) operand; 6 keeps the worked lines within ~60 characters."""

    @model_validator(mode="after")
    def _digit_range(self):
        if self.max_digits < self.min_digits:
            raise ValueError(f"max_digits={self.max_digits} is smaller than min_digits={self.min_digits}")
        return self


class ReverseConfig(_StringLengthConfig):
    """Reverse a lowercase string: "rev abc=" -> "cba" (answer only)."""

    type: Literal["reverse"] = "reverse"
    """Discriminator: string reversal."""
    name: str = Field("reverse", min_length=1)
    """Dataset name; it prefixes every problem_id and tags samples and metrics."""


class UppercaseConfig(_StringLengthConfig):
    """Copy a lowercase string in upper case: "up abc=" -> "ABC" (answer only)."""

    type: Literal["uppercase"] = "uppercase"
    """Discriminator: copy to upper case."""
    name: str = Field("upper", min_length=1)
    """Dataset name."""


class SortDigitsConfig(_StringLengthConfig):
    """Sort a digit string ascending: "sort 5391=" -> "1359" (answer only)."""

    type: Literal["sort_digits"] = "sort_digits"
    """Discriminator: sort the digits of a string."""
    name: str = Field("sort", min_length=1)
    """Dataset name."""


class CountCharConfig(_StringLengthConfig):
    """Count one character in a string, with a running count: "cnt a:abca=" -> "1112\\n2"."""

    type: Literal["count_char"] = "count_char"
    """Discriminator: count occurrences of a character."""
    name: str = Field("count", min_length=1)
    """Dataset name."""
    alphabet: str = Field("abc", min_length=2, pattern=r"^[a-z]+$")
    """Letters the string is drawn from; a small alphabet makes the target character common."""
    max_len: int = Field(9, ge=1, le=9)
    """Longest string; at most 9 so the running count is one digit per character."""


class SubtractionConfig(_DigitsConfig):
    """a - b with a >= b, column by column with explicit borrows (see rewards/domains.py)."""

    type: Literal["subtraction"] = "subtraction"
    """Discriminator: multi-digit subtraction."""
    name: str = Field("sub", min_length=1)
    """Dataset name."""
    max_digits: int = Field(3, ge=1, le=4)
    """Most digits of a; the worked lines grow ~8 characters per digit."""


class MultiplyDigitConfig(_DigitsConfig):
    """a * d for a one-digit d, column by column with carries: "47*6=" -> "7*6=42\\n4*6+4=28\\n282"."""

    type: Literal["multiply_digit"] = "multiply_digit"
    """Discriminator: multiplication by a single digit."""
    name: str = Field("mul", min_length=1)
    """Dataset name."""
    max_digits: int = Field(3, ge=1, le=4)
    """Most digits of a; the worked lines grow ~9 characters per digit."""


class ModuloConfig(_DigitsConfig):
    """n mod m for a one-digit m >= 2, by a running remainder: "123%7=" -> "1%7=1\\n12%7=5\\n53%7=4\\n4"."""

    type: Literal["modulo"] = "modulo"
    """Discriminator: remainder by long division (parity is m = 2)."""
    name: str = Field("mod", min_length=1)
    """Dataset name."""
    max_digits: int = Field(4, ge=1, le=5)
    """Most digits of n."""
    moduli: list[int] = Field(default_factory=lambda: [2, 3, 4, 5, 6, 7, 8, 9], min_length=1)
    """Divisors drawn uniformly; each in 2..9."""

    @model_validator(mode="after")
    def _moduli_range(self):
        bad = [m for m in self.moduli if not 2 <= m <= 9]
        if bad:
            raise ValueError(f"moduli must be in 2..9, got {bad}")
        return self


class MaxListConfig(_ProceduralConfig):
    """Largest of a list of two-digit numbers, with a running max: "max 37,92,41=" -> "37 92 92\\n92"."""

    type: Literal["max_list"] = "max_list"
    """Discriminator: maximum of a list."""
    name: str = Field("max", min_length=1)
    """Dataset name."""
    min_items: int = Field(2, ge=1)
    """Fewest numbers in the list."""
    max_items: int = Field(5, ge=1, le=6)
    """Most numbers in the list."""

    @model_validator(mode="after")
    def _item_range(self):
        if self.max_items < self.min_items:
            raise ValueError(f"max_items={self.max_items} is smaller than min_items={self.min_items}")
        return self


class BaseConversionConfig(_ProceduralConfig):
    """Decimal n to base k by repeated division: "13>b2=" -> "13:1\\n6:0\\n3:1\\n1:1\\n1101"."""

    type: Literal["base_conversion"] = "base_conversion"
    """Discriminator: decimal to base-k conversion."""
    name: str = Field("base", min_length=1)
    """Dataset name."""
    max_value: int = Field(127, ge=2, le=255)
    """Largest n (drawn uniformly from 0..max_value)."""
    bases: list[int] = Field(default_factory=lambda: [2, 3, 4, 5, 6, 7, 8, 9], min_length=1)
    """Target bases drawn uniformly; each in 2..9."""

    @model_validator(mode="after")
    def _base_range(self):
        bad = [k for k in self.bases if not 2 <= k <= 9]
        if bad:
            raise ValueError(f"bases must be in 2..9, got {bad}")
        return self


class DigitSumConfig(_DigitsConfig):
    """Sum of the digits with running partial sums: "dsum 4721=" -> "4 11 13 14\\n14"."""

    type: Literal["digit_sum"] = "digit_sum"
    """Discriminator: digit sum."""
    name: str = Field("dsum", min_length=1)
    """Dataset name."""
    min_digits: int = Field(2, ge=1)
    """Fewest digits."""
    max_digits: int = Field(6, ge=1, le=8)
    """Most digits."""


class CustomTaskConfig(StrictConfig):
    """A task class of the user's, named by import path and checked against `rewards.task.Task`."""

    type: Literal["custom"] = "custom"
    """Discriminator: a user-written task."""
    name: str = Field(min_length=1)
    """Dataset name; passed to the task's constructor as `name=`."""
    task: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path of the task class, "package.module:Class" (importable where the job runs)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the task's constructor besides `name` (JSON-able values)."""

    @model_validator(mode="after")
    def _importable_task(self) -> "CustomTaskConfig":
        missing = missing_task_methods(self.task_class())
        if missing:
            raise ValueError(f"task {self.task!r} does not implement the Task protocol (rewards/task.py): "
                             f"missing {', '.join(missing)}")
        return self

    def task_class(self) -> type:
        module_name, _, attr = self.task.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"cannot import task module {module_name!r} ({e})") from None
        cls = getattr(module, attr, None)
        if not isinstance(cls, type):
            raise ValueError(f"{self.task!r}: module {module_name!r} has no class {attr!r}")
        return cls

    def build(self) -> Task:
        task = self.task_class()(name=self.name, **self.args)
        if missing_task_methods(task) or getattr(task, "name", None) != self.name:
            raise ValueError(f"task {self.task!r} built with name={self.name!r} does not implement the Task "
                             f"protocol (missing {missing_task_methods(task) or ['name']})")
        return task


PROCEDURAL_DOMAIN_CONFIGS = (
    ReverseConfig, UppercaseConfig, SortDigitsConfig, CountCharConfig, SubtractionConfig,
    MultiplyDigitConfig, ModuloConfig, MaxListConfig, BaseConversionConfig, DigitSumConfig,
)
"""Every procedural domain's config class, besides ArithmeticConfig (recipe unions list these)."""

DatasetConfig = Annotated[
    Union[(ArithmeticConfig, LongTailConfig, CustomTaskConfig, *PROCEDURAL_DOMAIN_CONFIGS, *FILE_DATASET_CONFIGS)],
    Field(discriminator="type")]
"""A recipe's dataset: any task family, chosen by its `type:` key."""

DEFAULT_DOMAIN_CONFIGS = tuple(cls() for cls in PROCEDURAL_DOMAIN_CONFIGS)
"""One default-configured dataset per procedural domain (unique names), e.g. for a teacher per domain."""

