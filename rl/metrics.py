"""Metrics sinks: a JSONL file in the run directory always; wandb (offline by default) when installed.

metrics.jsonl is opened for append by configbase/files.py `open_append`: a symbolic link, a FIFO or a folder
planted at its name is refused in one line (`WriteRefused`), never written through.

wandb is optional: when it is not importable the run goes on with the JSONL file alone and says so
once. Metric names are namespaced (`rl/clip_frac`, `rollout/tokens_per_s`, `eval/accuracy`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from configbase.files import open_append
from rl.config import LoggingConfig


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, *, run_name: str, config: dict):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open_append(self.path)  # never through a link planted in the run directory (WriteRefused)
        self._wandb = None
        self.notes: list[str] = []
        if cfg.wandb and cfg.wandb_mode != "disabled":
            if importlib.util.find_spec("wandb") is None:
                self.notes.append("wandb is not installed: metrics go to metrics.jsonl only")
            else:
                os.environ.setdefault("WANDB_SILENT", "true")
                import wandb

                self._wandb = wandb.init(
                    project=cfg.project, name=run_name, dir=str(run_dir), mode=cfg.wandb_mode,
                    config=config, reinit="finish_previous",
                )

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def rollout_breakdown(samples) -> dict[str, float]:
    """Reward, accuracy and response length of a train batch's samples per dataset (when the batch mixes
    datasets: OPD's domains, a multi-task mixture), per effort level (effort control, seed §5.1.4) and per OPD teacher
    (the one the sample was dispatched for, seed §5.2.4): `rollout/<metric>/<dataset>`, `rollout/<metric>/effort<b>`
    and `rollout/<metric>/teacher_<name>`, beside the batch-wide `rollout/<metric>` (`rl ui` draws them with it)."""
    groups: dict[str, list] = {}
    if len({s.dataset for s in samples}) > 1:
        for s in samples:
            groups.setdefault(s.dataset, []).append(s)
    for s in samples:
        if s.effort is not None:
            groups.setdefault(f"effort{s.effort}", []).append(s)
        if s.teacher is not None:
            groups.setdefault(f"teacher_{s.teacher}", []).append(s)
    out = {}
    for name, group in sorted(groups.items()):
        n = len(group)
        out[f"rollout/reward/{name}"] = sum(s.reward for s in group) / n
        out[f"rollout/accuracy/{name}"] = sum(s.correct for s in group) / n
        out[f"rollout/response_len/{name}"] = sum(s.num_response_tokens for s in group) / n
    return out


CONCURRENCY_WINDOW = 50_000
"""Rollout calls whose concurrency RolloutClock keeps one by one (benches read them all: a few thousand calls)."""


@dataclass
class RolloutClock:
    """Concurrency and time accounting of the rollout phases (metrics and benchmarks)."""

    concurrency: list[float] = field(default_factory=list)
    """Sequences generating per engine step (tokens generated ÷ steps), summed over engines, per call: the last
    CONCURRENCY_WINDOW calls or more (`add_concurrency`; a day's run makes millions of calls, each checkpoint
    stores the list, and the mean is taken at every train step); the whole stage's mean is `concurrency_mean`."""
    interrupt_s: list[float] = field(default_factory=list)
    """Signal-to-idle time of every interrupt."""
    interrupt_late_steps: list[int] = field(default_factory=list)
    """Engine steps run after the batch became ready and before the engines stopped."""
    pipelined_calls: int = 0
    """Rollout calls queued on the workers while the controller read the call before (GRPOStage.pipelined_calls)."""
    rollout_s: float = 0.0
    """Seconds of the rollout phases (generating until a train batch is ready), periodic checkpoints apart."""
    train_s: float = 0.0
    """Seconds of the train steps (the optimizer steps, their bookkeeping and the weight update)."""
    weight_update_s: float = 0.0
    """Of train_s: seconds of the weight updates after the optimizer steps (`policy.update_weights`: the engines'
    bf16 copy refreshed and their fused weights rebuilt; on Ray workers, with the round trip). Absent from older
    checkpoints: 0."""
    generated_tokens: int = 0
    bytes_moved: int = 0
    engine_s: float = 0.0
    """Seconds of rollout calls on the workers (the slowest worker's, per call): rollout_s less this is the
    controller's share (dispatch, rewards, the store) and the round trips (with pipelined calls they overlap)."""
    worker_gap_s: float = 0.0
    """Of rollout_s: seconds the workers waited between consecutive rollout calls (`StepResult.gap_s`, the mean
    over workers, per call): with pipelined calls, where the controller's handling of a call outlasted the call
    queued behind it, and Ray's per-call overhead on the worker (absent from older checkpoints: 0)."""
    engine_steps: int = 0
    """Engine steps (the most any worker ran, per call)."""
    prefill_calls: int = 0
    """Prefill forwards, summed over the workers."""
    verify_s: float = 0.0
    """Controller seconds in submitting finished samples to the reward workers and reading their verdicts (in-process:
    the verification itself; on Ray: the calls, and the waits when a batch needs its rewards)."""
    reward_waits: int = 0
    """Times the controller blocked for verdicts because a train batch may have formed (AsyncGRPO.batch_may_form)."""
    reward_wait_s: float = 0.0
    """Of verify_s: seconds of those waits (reading verdicts included)."""
    store_s: float = 0.0
    """Controller seconds writing dispatched prompts and rewarded samples to the trajectory store (in the rollout
    loop: building the rows; the store's writer thread runs their statements, store_writer_s)."""
    store_writer_s: float = 0.0
    """Seconds of the store's writer thread running the rollout calls' writes, beside the controller (absent from
    older checkpoints: 0)."""
    dispatch_s: float = 0.0
    """Controller seconds releasing prompts: drawing problems, rendering and tokenising them, building the requests
    and queuing them on the workers (not their store writes: store_s)."""
    checkpoint_s: float = 0.0
    """Seconds of periodic checkpoints taken at token boundaries of the rollout phases (interrupt, the write, resume);
    not part of rollout_s."""
    uniform_groups_skipped: int = 0
    """Groups left out of train steps because every advantage was 0 (GRPOStage.skip_uniform_groups)."""
    concurrency_sum: float = 0.0
    """Σ `concurrency` over every call of the stage, those the window let go included (a checkpoint written before
    the window has neither field: `ckpt_records.clock_from_record` takes them from its whole list)."""
    concurrency_calls: int = 0
    parks: int = 0
    """Samples parked because an engine's KV pool ran dry (rollout/engine.py `_grow`), summed over the workers."""
    parked_bytes: int = 0
    """Bytes of KV those parks copied to host memory."""
    parked: int = 0
    """Samples parked at the end of the last rollout call, summed over the workers."""
    kv_used_sum: float = 0.0
    """Σ over rollout calls of the workers' mean share of their KV pool held (`kv_used_frac`)."""
    kv_used_calls: int = 0
    reprefill_tokens: int = 0
    """Generated tokens prefilled again because their KV was dropped (parked past `engine.park_host_gib`)."""

    def add_concurrency(self, x: float) -> None:
        self.concurrency.append(x)
        self.concurrency_sum += x
        self.concurrency_calls += 1
        if len(self.concurrency) >= 2 * CONCURRENCY_WINDOW:  # amortised: one cut per CONCURRENCY_WINDOW calls
            del self.concurrency[:-CONCURRENCY_WINDOW]

    @property
    def concurrency_mean(self) -> float:
        return self.concurrency_sum / max(self.concurrency_calls, 1)
