"""Sandbox latency and throughput, and the hostile-code suite (issue #16).

    python bench/sandbox.py [--quick] [--backend bwrap|process] [--json PATH]

One local server (sandbox_client.LocalServer) with the chosen backend. Each item is what a verifier does
with untrusted code: a fresh sandbox, `python3 -c` of a short snippet, close. Per item: create ms, exec ms
(spawn to the end of its output), close ms; `first_output` is create + exec (the goal: p50 <= 50 ms) and
`total` adds the close. Items run `--items` per level at concurrency 1, 8 and 32 (a semaphore over one
client connection, as `run_batch` does), after a warm-up; executions per second = items / wall time of the
level. Then the hostile suite (sandbox_client/hostile.py) runs against the same backend.
Multi-turn samples (`turns`): 3 calls each with the tool turns' snapshot before every call after the first, 32 at
a time, with calls that only print (an empty work directory: its snapshot runs no exec) and calls that write a file
(tar at every snapshot). Then samples of 8 printing calls (`long`: a warm interpreter's start spread over more calls; a quarter as many
samples). `--quick` runs the warm server's one-call levels at concurrency 8 and 32 only. Every arm runs on
two servers of the same backend side by side, cold (every call a spawn)
and warm (Python calls forked from a warm interpreter per sandbox, sandbox_client/warm.py), alternating arm by arm.
Last line: RESULT backend=<name> p50_ms=<create+exec+close p50 at concurrency 1, cold> p99_ms=<its p99>
execs_per_s=<best level, cold> execs_per_s_warm=<best level, warm> turn_calls_per_s=<printing calls, cold>
turn_calls_per_s_warm=<printing calls, warm> turn_calls_per_s_tar=<writing calls, cold>
turn_calls_per_s_tar_warm=<writing calls, warm> warm_over_cold=<printing calls, warm / cold>
long_turn_calls_per_s=<8-call samples, cold> long_turn_calls_per_s_warm=<8-call samples, warm>
long_warm_over_cold=<their ratio>
hostile_contained=<n>/<total> (the hostile suite against the warm server)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox_client import Limits, LocalServer, SandboxClient  # noqa: E402
from sandbox_client.hostile import CASES, HostWorld, run_case  # noqa: E402

SNIPPET = "import sys; print(sum(i * i for i in range(1000)), sys.version_info[0])"
EXPECTED = f"{sum(i * i for i in range(1000))} 3\n"
LIMITS = Limits(memory_mib=256, cpu_s=5, max_processes=32, timeout_s=10)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def level(socket_path: Path, concurrency: int, items: int) -> dict:
    """`items` create+exec+close cycles, `concurrency` at a time; per-phase latencies in ms."""
    rows: list[tuple[float, float, float]] = []
    wrong = 0
    gate = asyncio.Semaphore(concurrency)
    async with await SandboxClient.connect(socket_path) as client:
        async def one() -> None:
            nonlocal wrong
            async with gate:
                t0 = time.perf_counter()
                sb = await client.create_waiting(LIMITS)
                t1 = time.perf_counter()
                r = await sb.exec(code=SNIPPET)
                t2 = time.perf_counter()
                await sb.close()
                t3 = time.perf_counter()
            wrong += r.stdout_text != EXPECTED
            rows.append((1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)))

        await asyncio.gather(*(one() for _ in range(min(items, 2 * concurrency))))  # warm-up, not counted
        rows.clear()
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(items)))
        wall = time.perf_counter() - start
    first = [c + e for c, e, _ in rows]
    total = [c + e + x for c, e, x in rows]
    return {"concurrency": concurrency, "items": items, "wrong_output": wrong, "execs_per_s": items / wall,
            "create_p50": statistics.median(r[0] for r in rows), "exec_p50": statistics.median(r[1] for r in rows),
            "close_p50": statistics.median(r[2] for r in rows), "first_output_p50": statistics.median(first),
            "total_p50": statistics.median(total), "total_p99": pct(total, 0.99)}


async def turns(socket_path: Path, concurrency: int, samples: int, calls: int, write: bool) -> dict:
    """Multi-turn samples as rl/runtime/tool_turns.py runs them: a sandbox each, `calls` calls of `python3 -c`, the
    work directory snapshot before every call after the first (what a checkpoint would keep), `concurrency` samples
    at a time. `write`: every call writes a file (each snapshot runs tar); else the calls only print (the work
    directory stays empty: the snapshot is b"", no exec). Tool calls per second over the wall time."""
    gate = asyncio.Semaphore(concurrency)
    code = "open('state.txt', 'a').write('x'); print(6 * 7)" if write else "print(6 * 7)"
    async with await SandboxClient.connect(socket_path) as client:
        async def one() -> None:
            async with gate:
                sb = await client.create_waiting(LIMITS)
                for c in range(calls):
                    if c:
                        await sb.snapshot()
                    await sb.exec(code=code)
                await sb.close()

        await asyncio.gather(*(one() for _ in range(min(samples, concurrency))))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(samples)))
        wall = time.perf_counter() - start
    return {"write": write, "samples": samples, "calls": calls, "calls_per_s": samples * calls / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke size: under a minute")
    ap.add_argument("--backend", default="bwrap", choices=["bwrap", "process"])
    ap.add_argument("--items", type=int, default=None, help="timed items per concurrency level (quick 64, else 400)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    items = a.items or (64 if a.quick else 400)
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-bench-"))
    samples = 64 if a.quick else 256
    try:
        with HostWorld(scratch, backend=a.backend, max_sandboxes=64) as world:
            cold_server = LocalServer(scratch / "cold.sock", scratch / "cold.state", backend=a.backend, max_sandboxes=64,
                                      warm_interpreter=False)
            try:
                paths = {"cold": cold_server.socket_path, "warm": world.socket_path}
                levels = {k: [] for k in paths}
                for c in (1, 8, 32):
                    for k, path in paths.items():
                        if k == "cold" or c > 1 or not a.quick:  # quick: a one-call sandbox's warm latency is noise
                            levels[k].append(asyncio.run(level(path, c, max(items, 2 * c))))
                multi = {k: [] for k in paths}
                for w in (False, True):
                    for k, path in paths.items():
                        multi[k].append(asyncio.run(turns(path, 32, samples, 3, w)))
                for k, path in paths.items():
                    multi[k].append(asyncio.run(turns(path, 32, samples // 4, 8, False)))
            finally:
                cold_server.stop()
            for k in paths:
                print(f"backend {a.backend}, {k}: fresh sandbox + python3 -c + close, ms (p50 unless marked)")
                print(f"{'conc':>5s} {'items':>6s} {'create':>7s} {'exec':>7s} {'close':>7s} {'first_out':>10s} {'total':>7s} "
                      f"{'total_p99':>10s} {'execs/s':>8s} {'wrong':>6s}")
                for r in levels[k]:
                    print(f"{r['concurrency']:5d} {r['items']:6d} {r['create_p50']:7.1f} {r['exec_p50']:7.1f} {r['close_p50']:7.1f} "
                          f"{r['first_output_p50']:10.1f} {r['total_p50']:7.1f} {r['total_p99']:10.1f} {r['execs_per_s']:8.1f} "
                          f"{r['wrong_output']:6d}")
            print("multi-turn samples, 32 at a time, 3 calls each (8 in the last arm), a snapshot before each call after the "
                  "first (calls/s):")
            print(f"  {'':44s} {'cold':>7s} {'warm':>7s} {'warm/cold':>9s}")
            arms = ("calls that only print (empty: no tar)", "calls writing a file (tar at every snapshot)",
                    "8 calls a sample, printing")
            for arm, cold, warm in zip(arms, multi["cold"], multi["warm"]):
                print(f"  {arm:44s} "
                      f"{cold['calls_per_s']:7.1f} {warm['calls_per_s']:7.1f} {warm['calls_per_s'] / cold['calls_per_s']:8.2f}x")
            outcomes = [run_case(name, world) for name in CASES]
        print(f"\nhostile suite ({a.backend}, warm interpreter on):")
        for o in outcomes:
            print(f"  {o.case:22s} {'contained' if o.contained else 'NOT CONTAINED':14s} {o.reason or '-':17s} {o.detail}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    contained = sum(o.contained for o in outcomes)
    solo = levels["cold"][0]
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "levels": levels, "turns": multi,
                                            "hostile": [o.__dict__ for o in outcomes]}, indent=1))
    print(f"RESULT backend={a.backend} p50_ms={solo['total_p50']:.1f} p99_ms={solo['total_p99']:.1f} "
          f"execs_per_s={max(r['execs_per_s'] for r in levels['cold']):.1f} "
          f"execs_per_s_warm={max(r['execs_per_s'] for r in levels['warm']):.1f} "
          f"turn_calls_per_s={multi['cold'][0]['calls_per_s']:.1f} turn_calls_per_s_warm={multi['warm'][0]['calls_per_s']:.1f} "
          f"turn_calls_per_s_tar={multi['cold'][1]['calls_per_s']:.1f} "
          f"turn_calls_per_s_tar_warm={multi['warm'][1]['calls_per_s']:.1f} "
          f"warm_over_cold={multi['warm'][0]['calls_per_s'] / multi['cold'][0]['calls_per_s']:.2f} "
          f"long_turn_calls_per_s={multi['cold'][2]['calls_per_s']:.1f} long_turn_calls_per_s_warm={multi['warm'][2]['calls_per_s']:.1f} "
          f"long_warm_over_cold={multi['warm'][2]['calls_per_s'] / multi['cold'][2]['calls_per_s']:.2f} "
          f"hostile_contained={contained}/{len(outcomes)}")


if __name__ == "__main__":
    main()
