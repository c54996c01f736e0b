"""Repercussion (seed §5.1.3: "if an agent crashes its environment, we treat the crash as a failed trajectory and
report a 'repercussion' signal to the RL framework"): what a sandbox failure during a tool call does to training.

A call whose sandbox failed ends its sample there (rl/runtime/tool_turns.py) and the sample carries the reason,
`Sample.failure`, one of `FAILURES`: the server's reason for killing the call (`timeout` wall clock, `cpu`
time, `memory`, `processes` count, `output_truncated`: the output passed its cap, `crashed`: a signal no limit
sent), `refused` (no sandbox admitted within the admission retries) or `sandbox_error` (the server could not be
reached or failed the request). A call that ran to its end, whatever its exit code, is no failure.

`tools.on_failure` says what training does with such a sample:
  zero_reward   its reward is 0 (the verifier's reward and any length penalty replaced; the store keeps 0 and
                says why in `reason`); it trains like any sample, inside its group, so its group's baseline
                counts it: the failure is penalised relative to its siblings, as a wrong answer is.
  leave_loss    it leaves the step: none of its tokens enters the loss or the token normaliser, and the GRPO
                baseline of its group (mean, and std with `std_normalize`) is taken over the group's other
                samples (`group_advantages` over the kept ones), so a failure neither earns a gradient nor
                shifts its siblings' advantages. A group left with one sample has advantage 0. The sample stays
                in the store, untrained (train_step NULL). As verl/prime-rl users mask a filtered sample out.
The job never stops for either. `failure_counts` gives the per-step metrics `rollout/tool_failures/<reason>`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from rl.types import Sample

FAILURES: tuple[str, ...] = ("timeout", "cpu", "memory", "processes", "output_truncated", "crashed", "refused",
                             "sandbox_error")
"""Every reason a sample may fail for (`Sample.failure`)."""


def failure_of(tool_turns: Sequence[Mapping]) -> str | None:
    """The failure of a generation's tool-turn records (rl/runtime/tool_turns.py puts it on the call that ended it)."""
    return next((t["failure"] for t in tool_turns if t.get("failure")), None)


def settle(sample: Sample, on_failure: str) -> Sample:
    """The sample as stored and trained: a failed one gets reward 0 under `zero_reward`; otherwise unchanged."""
    if sample.failure is None or on_failure != "zero_reward":
        return sample
    return dataclasses.replace(sample, reward=0.0, reason=f"tool failure ({sample.failure}): reward 0 "
                                                         f"(tools.on_failure=zero_reward); verifier: {sample.reason}")


def trained(samples: Sequence[Sample], on_failure: str | None) -> list[Sample]:
    """The samples that enter the step's loss and baselines: all, or under `leave_loss` all but the failed."""
    if on_failure == "leave_loss":
        return [s for s in samples if s.failure is None]
    return list(samples)


def failure_counts(samples: Sequence[Sample]) -> dict[str, float]:
    """`rollout/tool_failures/<reason>` for every reason (0 included, so each is a series) and the total."""
    counts = Counter(s.failure for s in samples if s.failure is not None)
    out = {f"rollout/tool_failures/{r}": float(counts.get(r, 0)) for r in FAILURES}
    out["rollout/tool_failures"] = float(sum(counts.values()))
    return out
