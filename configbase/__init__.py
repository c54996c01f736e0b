"""`StrictConfig`: the shared base of every component config in asyncrl.

The one module every package may import (model/, rollout/, rewards/, teachers/, rl/, sandbox_client/);
it imports nothing of ours and neither torch nor ray, so config modules built on it validate recipes
instantly. Unknown keys are rejected, every field carries a one-line docstring (pydantic turns it into
the field description), instances are immutable once validated, and no float of any config may be NaN or
infinite (a learning rate of `inf` validates as a float but trains NaN; `allow_inf_nan=False` refuses it at the
recipe, the patch and `--set` alike). `finite_float` is the same rule for a float given on a command line.
`configbase.files` is the one helper for every file the project writes (never through a link, never over what
the command did not create).
"""

from __future__ import annotations

import argparse
import math

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictConfig", "finite_float"]


class StrictConfig(BaseModel):
    """Base of all component configs: strict keys, documented fields, immutable."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)


def finite_float(text: str) -> float:
    """An argparse `type` for a float argument: a finite number, else argparse's one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value
