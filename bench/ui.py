"""The dashboard's reads at scale (issue #45 item 4): a store of generated samples with their per-token arrays, then
the samples table at random deep offsets under every filter and sort, single sample pages, and a long curve, each
timed cold (a fresh `Dashboard`, so no Python-side cache) through rl/ui/data.py as the server calls it.

    python bench/ui.py --quick                 # 20,000 samples of 256 tokens, a 100K-step curve (~40 s on this CPU)
    python bench/ui.py --samples 1000000 --tokens 2048   # the issue's scale (a ~25 GB store: disk and an hour)

The store is written once per (samples, tokens) under --dir and reused. `writes_to_store`: files of the run directory
whose bytes changed while the dashboard read (must be 0). Last line:
RESULT samples=<n> page_ms_p50=<x> page_ms_p95=<x> sample_ms_p50=<y> sample_ms_p95=<y> curve_ms=<z> writes_to_store=<n>
live_commit_ms_p95_alone=<x> live_commit_ms_p95_polled=<x> live_wal_mib_polled=<x> (a live store: a job's writer with
and without the dashboard polling it)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.ui.data import Dashboard  # noqa: E402


def build(run: Path, n: int, tokens: int, steps: int) -> None:
    import numpy as np
    import yaml

    from rl.store.trajectories import TrajectoryStore
    from rl.types import Sample

    run.mkdir(parents=True, exist_ok=True)
    (run / "recipe.yaml").write_text(yaml.safe_dump({"run": {"name": "ui-bench"}, "datasets": [{"type": "arithmetic"}]}))
    store = TrajectoryStore.for_run_dir(run, name="ui-bench")
    rng, g = random.Random(0), np.random.default_rng(0)
    datasets, teachers = ["wp", "compute", "extract", "effort"], [None, "t0", "t1", "t2"]
    done, chunk = 0, 2000
    while done < n:
        k = min(n, done + chunk) - done
        toks, logps = g.integers(3, 99, size=(k, tokens)).tolist(), (-g.random((k, tokens))).tolist()
        batch = []
        for j, i in enumerate(range(done, done + k)):
            v = i // 256
            batch.append(Sample(
                sample_id=f"s{i:08d}", prompt_id=f"p{i // 8:08d}", dataset=datasets[i % 4], group_id=f"p{i // 8:08d}",
                prompt_tokens=(1, 20, 21, 22), response_tokens=tuple(toks[j]), prompt_text="What is 6*7?",
                response_text="x" * tokens, behavior_logprobs_T=tuple(logps[j]),
                policy_versions_T=(v,) * (tokens // 2) + (v + rng.randrange(0, 3),) * (tokens - tokens // 2),
                reward=float(rng.random() < 0.4), correct=False, finish_reason=rng.choice(["eos", "length"]),
                status="finished", timings={"finished_at": float(i)}, teacher=teachers[i % 4],
                effort=rng.choice([None, 25, 50, 100]), reason="checked"))
        store.add_samples(batch)
        store.mark_trained([s.sample_id for s in batch], step=done // chunk + 1)
        done += k
        print(f"  wrote {done:,} samples", end="\r", flush=True)
    store.close()
    with (run / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "time": float(s), "rollout/reward": rng.random(), "rl/entropy": rng.random()}) + "\n")
    print()


def live(root: Path, seconds: float, poll: bool) -> dict:
    """A job's writer adding 64 samples of 256 tokens every 50 ms to a live store for `seconds`, with the dashboard
    polling a samples page and a sample page every 100 ms, or not: the writer's commit latencies (ms) and the WAL's
    largest size (MiB)."""
    import shutil
    import threading

    from rl.store.trajectories import TrajectoryStore
    from rl.types import Sample

    run = root / ("live-poll" if poll else "live-alone")
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    store = TrajectoryStore.for_run_dir(run, name="ui-live")
    rng = random.Random(2)
    lat, wal, stop, n = [], [0], threading.Event(), [0]

    def batch(k: int) -> list:
        return [Sample(sample_id=f"s{k:06d}-{j}", prompt_id=f"p{k}", dataset="wp", group_id=f"p{k}", prompt_tokens=(1, 5),
                       response_tokens=tuple(rng.randrange(3, 99) for _ in range(256)), prompt_text="q",
                       response_text="x" * 256, behavior_logprobs_T=(-0.5,) * 256, policy_versions_T=(k,) * 256,
                       reward=1.0, correct=True, finish_reason="eos", status="finished", timings={"finished_at": float(k)})
                for j in range(64)]

    def reader() -> None:
        d = Dashboard([run])
        while not stop.is_set():
            try:
                page = d.samples("0", {"sort": "-seq", "limit": "50"})
                if page["rows"]:
                    d.sample("0", page["rows"][0]["sample_id"])
            except Exception:
                pass  # before the first commit: no store yet
            time.sleep(0.1)
        d.close()

    t = threading.Thread(target=reader) if poll else None
    if t:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        b = batch(n[0])
        t0 = time.perf_counter()
        store.add_samples(b)
        lat.append(1e3 * (time.perf_counter() - t0))
        n[0] += 1
        w = run / "trajectories.db-wal"
        wal[0] = max(wal[0], w.stat().st_size if w.exists() else 0)
        time.sleep(0.05)
    stop.set()
    if t:
        t.join()
    store.close()
    return {"p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "max": max(lat), "wal_mib": wal[0] / 2**20, "batches": len(lat)}


def digests(d: Path) -> dict[str, tuple]:
    """Each file's size and modification time, and its sha256 up to 1 GiB (a write moves the time; a 30 GB store is
    not read whole)."""
    out = {}
    for p in sorted(d.iterdir()):
        if p.is_file():
            st = p.stat()
            out[p.name] = (st.st_size, st.st_mtime_ns,
                           hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size <= 2**30 else None)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--steps", type=int, default=100_000, help="rows of the curve's metrics.jsonl")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/asyncrl-ui-bench"))
    ap.add_argument("--live-s", type=float, default=8.0, help="seconds of each live-store arm (writer alone, polled)")
    ap.add_argument("--requests", type=int, default=None, help="timed requests of each kind")
    a = ap.parse_args()
    n, tokens = a.samples or (20_000 if a.quick else 1_000_000), a.tokens or (256 if a.quick else 2048)
    reqs = a.requests or (81 if a.quick else 162)  # every filter x sort pair: once, twice
    run = a.dir / f"run-{n}-{tokens}"
    if not (run / "trajectories.db").is_file():
        print(f"writing {n:,} samples of {tokens} tokens to {run}", flush=True)
        build(run, n, tokens, a.steps)
    else:  # the bench's own cached store, written by older code: to this code's schema (before the reads are watched)
        from rl.store.db import sqlite_url, upgrade_store

        upgrade_store(sqlite_url(run / "trajectories.db"))
    before = digests(run)
    rng = random.Random(1)
    filters = [{}, {"dataset": "compute"}, {"step": "3"}, {"min_reward": "1"}, {"finish_reason": "length"},
               {"effort": "50"}, {"teacher": "t1"}, {"min_lag": "1"}, {"dataset": "wp", "min_reward": "1", "effort": "100"}]
    sorts = ["seq", "-seq", "reward", "-reward", "step", "-step", "length", "lag", "-lag"]
    page_ms, sample_ms = [], []
    for i in range(reqs):
        d = Dashboard([run])  # cold: no cache of the dashboard's own
        params = {**filters[i % len(filters)], "sort": sorts[(i // len(filters)) % len(sorts)], "offset": str(rng.randrange(0, max(1, n - 50))),
                  "limit": "50"}
        t = time.perf_counter()
        d.samples("0", params)
        page_ms.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        d.sample("0", f"s{rng.randrange(n):08d}")
        sample_ms.append(1e3 * (time.perf_counter() - t))
        d.close()
    d = Dashboard([run])
    t = time.perf_counter()
    c = d.curve("0", "rollout/reward")
    curve_ms = 1e3 * (time.perf_counter() - t)
    d.close()
    writes = sum(1 for k, v in digests(run).items() if before.get(k) != v) + len(set(digests(run)) - set(before))
    alone, polled = live(a.dir, a.live_s, poll=False), live(a.dir, a.live_s, poll=True)
    print(f"live store, a writer adding 64 samples every 50 ms for {a.live_s:.0f} s: commit p50 / p95 / max "
          f"{alone['p50']:.1f} / {alone['p95']:.1f} / {alone['max']:.1f} ms alone, {polled['p50']:.1f} / "
          f"{polled['p95']:.1f} / {polled['max']:.1f} ms while the dashboard polls every 100 ms; WAL at most "
          f"{alone['wal_mib']:.1f} / {polled['wal_mib']:.1f} MiB")
    print(f"samples table: p50 {pct(page_ms, 0.5):.1f} ms, p95 {pct(page_ms, 0.95):.1f} ms ({reqs} pages, random offsets "
          f"up to {n - 50:,}, {len(filters)} filters x {len(sorts)} sorts); sample page: p50 {pct(sample_ms, 0.5):.1f} ms, "
          f"p95 {pct(sample_ms, 0.95):.1f} ms; curve of {c['points']:,} steps -> {len(c['x']):,} points: {curve_ms:.0f} ms")
    print(f"RESULT samples={n} page_ms_p50={pct(page_ms, 0.5):.1f} page_ms_p95={pct(page_ms, 0.95):.1f} "
          f"sample_ms_p50={pct(sample_ms, 0.5):.1f} sample_ms_p95={pct(sample_ms, 0.95):.1f} curve_ms={curve_ms:.0f} "
          f"writes_to_store={writes} live_commit_ms_p95_alone={alone['p95']:.1f} live_commit_ms_p95_polled={polled['p95']:.1f} "
          f"live_wal_mib_polled={polled['wal_mib']:.1f}")


if __name__ == "__main__":
    main()
