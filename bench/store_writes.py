"""The controller's trajectory-store writes per rollout call, one transaction per write against one per call
(`TrajectoryStore.batch()`, issue #15's "where a rollout step's time goes").

    python bench/store_writes.py [--quick] [--calls 2000] [--url postgresql://...]

A rollout call of the SmolLM2 GRPO arm on an H200 (run O, BENCHMARKS.md: 55,512 engine steps in 4-step calls,
~37,700 prompts, ~301,000 samples) releases ~3 prompts, finishes ~22 samples of ~100 response tokens and closes ~2
groups. Arms, in turn on fresh run ids of one database: `each` writes them as the controller did before
`batch()` (a transaction per prompt, one for the samples, one for the outcomes), `batch` as it did before background batches (one insert
of the prompts, then the samples and the outcomes, all in one transaction). Default: SQLite in a temporary
directory (the run directory's store); `--url` another database.

A third arm, `background` (`batch(background=True)`, as the controller writes now), times the caller's own share: the
block builds the rows and the store's writer thread runs the statements; between calls every arm sleeps --gap-ms
(the controller waiting on the engines, which is when the writer runs). The caller's time excludes the gaps.

Last line: RESULT each_ms_per_call=.. batch_ms_per_call=.. batch_speedup=.. each_ms_per_sample=.. batch_ms_per_sample=..
background_ms_per_call=.. background_speedup_over_batch=.. background_writer_ms_per_call=..
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.store.trajectories import TrajectoryStore  # noqa: E402
from rl.store.db import sqlite_url  # noqa: E402
from rl.types import Prompt, Sample  # noqa: E402


def call_writes(call: int, prompts: int, samples: int, tokens: int) -> tuple[list[Prompt], list[Sample], list[str]]:
    """One rollout call's writes: its new prompts, the samples that finished (of earlier prompts) and the groups
    closed (filtered)."""
    ps = [Prompt(f"p{call}-{j}", "wp", "<|im_start|>user\nTom has 57 apples ...<|im_end|>\n" * 2, tuple(range(100)),
                 "19", 8, call // 50) for j in range(prompts)]
    owners = [f"p{max(call - 1, 0)}-{j % prompts}" for j in range(samples)]
    ss = [Sample(sample_id=f"{owners[k]}-c{call}-{k}", prompt_id=owners[k], dataset="wp", group_id=owners[k],
                 prompt_tokens=tuple(range(100)), response_tokens=tuple(range(1000, 1000 + tokens)),
                 prompt_text=ps[0].text, response_text="57 - 38 = 19. The answer is 19. " * (tokens // 12),
                 behavior_logprobs_T=tuple(-0.01 * (i % 7) for i in range(tokens)),
                 policy_versions_T=tuple(call // 50 + (i > tokens // 2) for i in range(tokens)), reward=1.0,
                 correct=True, finish_reason="stop", status="finished",
                 timings={"finished_at": 1.0, "generate_s": 0.5}) for k in range(samples)]
    closed = [f"p{max(call - 2, 0)}-{j}" for j in range(min(2, prompts))]
    return ps, ss, closed


def write_each(store: TrajectoryStore, ps, ss, closed) -> None:
    for p in ps:
        store.add_prompts([p])
    store.add_samples(ss)
    store.set_outcome(closed, "filtered")


def write_batch(store: TrajectoryStore, ps, ss, closed) -> None:
    with store.batch():
        store.add_prompts(ps)
        store.add_samples(ss)
        store.set_outcome(closed, "filtered")


def write_background(store: TrajectoryStore, ps, ss, closed) -> None:
    with store.batch(background=True):
        store.add_prompts(ps)
        store.add_samples(ss)
        store.set_outcome(closed, "filtered")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 calls a run, 2 rounds (seconds)")
    ap.add_argument("--calls", type=int, default=2000, help="rollout calls per timed run")
    ap.add_argument("--rounds", type=int, default=3, help="each arm this many times, in turn")
    ap.add_argument("--prompts", type=int, default=3, help="prompts released per call")
    ap.add_argument("--samples", type=int, default=22, help="samples finished per call")
    ap.add_argument("--tokens", type=int, default=100, help="response tokens per sample")
    ap.add_argument("--url", help="a database URL (default: SQLite in a temporary directory)")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="sleep between calls, in every arm: the controller "
                    "waiting on the engines' next call (the GIL free), when a background batch's writes run")
    a = ap.parse_args()
    calls, rounds = (300, 2) if a.quick else (a.calls, a.rounds)
    work = [call_writes(c, a.prompts, a.samples, a.tokens) for c in range(calls)]
    tmp = tempfile.TemporaryDirectory()
    url = a.url or sqlite_url(Path(tmp.name) / "trajectories.db")
    arms = {"each": write_each, "batch": write_batch, "background": write_background}
    times: dict[str, list[float]] = {name: [] for name in arms}
    drains, writer = [], []
    for r in range(rounds):
        for name, write in arms.items():
            store = TrajectoryStore(url, f"{name}-{r}")
            store.add_run(store.run_id, "{}")
            caller = 0.0  # the caller's own time in the writes (the gaps apart)
            for ps, ss, closed in work:
                t0 = time.perf_counter()
                write(store, ps, ss, closed)
                caller += time.perf_counter() - t0
                time.sleep(a.gap_ms / 1e3)
            t0 = time.perf_counter()
            assert store.count_samples() == calls * a.samples  # a read: waits for the background batches
            if name == "background":
                drains.append(time.perf_counter() - t0)
                writer.append(store.writer_s / calls)
            times[name].append(caller / calls)
            store.close()
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name in arms:
        print(f"{name:<10} {ms[name]:.3f} ms a call of the caller's ({ms[name] / a.samples:.4f} ms a sample); runs: "
              + ", ".join(f"{t * 1e3:.3f}" for t in times[name]))
    print(f"background: the writer thread {statistics.median(writer) * 1e3:.3f} ms a call; the final read waited "
          f"{statistics.median(drains) * 1e3:.1f} ms for it")
    print(f"RESULT each_ms_per_call={ms['each']:.4g} batch_ms_per_call={ms['batch']:.4g} "
          f"batch_speedup={ms['each'] / ms['batch']:.3f} each_ms_per_sample={ms['each'] / a.samples:.4g} "
          f"batch_ms_per_sample={ms['batch'] / a.samples:.4g} background_ms_per_call={ms['background']:.4g} "
          f"background_speedup_over_batch={ms['batch'] / ms['background']:.3f} "
          f"background_writer_ms_per_call={statistics.median(writer) * 1e3:.4g}")


if __name__ == "__main__":
    main()
