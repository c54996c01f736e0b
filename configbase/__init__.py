"""`StrictConfig`: the shared base of every component config in asyncrl.

The one module every package may import (model/, rollout/, rewards/, teachers/, rl/, sandbox_client/);
it imports nothing of ours and neither torch nor ray, so config modules built on it validate recipes
instantly. Unknown keys are rejected, every field carries a one-line docstring (pydantic turns it into
the field description), and instances are immutable once validated.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictConfig"]


class StrictConfig(BaseModel):
    """Base of all component configs: strict keys, documented fields, immutable."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
