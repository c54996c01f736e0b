"""Dispatch policies side by side on a long-tail response-length workload (issue #3 evidence).

    python bench/async_dispatch.py [--quick] [--device cuda] [--ray] [--hidden 512 --layers 8 ...]

The same randomly initialised policy, the same prompts (forced-length mode: each response ends at a
length drawn from a log-normal, p99/p50 = exp(2.326·sigma)), the same train batch, run under `sync`,
`batch`, `prompt` and `sample` dispatch one after the other in one process. Per policy: trained
samples/s (whole wall time, training included), generated tokens/s during rollout, rollout
concurrency (mean, std, share of engine steps within 5% of max_inflight), idle fraction (unused
engine slots over the rollout steps), re-prefilled tokens, interrupt latency in engine steps (p99).
Last line: RESULT speedup_sample_vs_sync=.. concurrency_held=.. reprefill_tokens=.. interrupt_p99_steps=..
`--repeats N` runs the arms N times in turn and reports medians; `--warmup` pays the process's compiles in an untimed
run first; `--fresh-processes` runs every run (the warm-up's too) in a new Python process. `--actor-vs-inprocess`,
`--engine-ab` and `--prefill-intervals 1,4` compare the `sample` policy's runs instead (their own RESULT lines); each
run also reports the engine's share of the rollout time (the rest: the controller and round trips) and the share of
engine steps that carried a prefill.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl.algo.async_grpo import run_async_grpo
from rl.config import Recipe
from rl.algo.job import open_job

POLICIES = ("sync", "batch", "prompt", "sample")


def recipe_for(policy: str, a, ray: bool | None = None, pipelined: bool = True, prefill_interval: int | None = None,
               engine: dict | None = None) -> Recipe:
    inflight = a.prompts * a.group
    ray = a.ray if ray is None else ray
    return Recipe.model_validate({
        "run": {"name": f"bench-{policy}", "seed": 0, "device": a.device, "num_threads": a.threads,
                "compile": a.compile, **({"dtype": a.dtype} if a.dtype else {})},
        "model": {"hidden_size": a.hidden, "num_layers": a.layers, "num_heads": a.heads, "num_kv_heads": max(1, a.heads // 2),
                  "head_dim": a.hidden // a.heads, "max_position_embeddings": a.max_tokens + 16,
                  "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": a.hidden}
                  if a.ffn == "moe" else {"type": "dense", "intermediate_size": 4 * a.hidden}},
        "datasets": [{"type": "longtail", "median_tokens": a.median, "sigma": a.sigma, "max_tokens": a.max_tokens}],
        "engine": {"max_batch_size": inflight, "block_size": 16, "max_seq_len": a.max_tokens + 16,
                   "prefill_interval": prefill_interval, **(engine or {})},
        "runtime": {"ray": True, "num_workers": 1, "num_cpus": 2} if ray else {"ray": False},
        "stages": [{"type": "grpo", "max_steps": a.steps, "prompts_per_step": a.prompts, "group_size": a.group,
                    "micro_batch_size": a.micro_batch, "optim": {"lr": 1e-5}, "pipelined_calls": pipelined,
                    "dispatch": {"policy": policy, "max_inflight": inflight, "batch_prefill": 2}}],
        "logging": {"wandb": False, "progress_bar": False},
    })


def run(policy: str, a, out: Path, ray: bool | None = None, pipelined: bool = True, tag: str = "",
        prefill_interval: int | None = None, engine: dict | None = None) -> dict:
    recipe = recipe_for(policy, a, ray, pipelined, prefill_interval, engine)
    run_dir = out / (tag or policy)
    run_dir.mkdir(parents=True)
    with open_job(recipe, run_dir, checkpoints=False) as job:
        t0 = time.perf_counter()
        clock = run_async_grpo(job, recipe.stages[0], 0).clock
        wall = time.perf_counter() - t0
        info = job.policy.info()
    inflight = a.prompts * a.group
    conc = clock.concurrency
    late = sorted(clock.interrupt_late_steps)
    steady = steady_rates(run_dir / "metrics.jsonl", a.steady_after, inflight)
    return {
        "policy": policy,
        "trained_samples_per_s": a.steps * inflight / wall,
        "gen_tokens_per_s": clock.generated_tokens / max(clock.rollout_s, 1e-9),
        "concurrency_mean": statistics.fmean(conc),
        "concurrency_std": statistics.pstdev(conc),
        "concurrency_held": sum(c >= 0.95 * inflight for c in conc) / len(conc),
        "idle_frac": 1 - sum(conc) / (len(conc) * inflight),
        "reprefill_tokens": sum(i["reprefill_tokens"] for i in info),
        "interrupt_p99_steps": late[min(len(late) - 1, math.ceil(0.99 * len(late)) - 1)],
        "rollout_s": clock.rollout_s,
        "train_s": clock.train_s,
        "weight_update_s": clock.weight_update_s,  # of train_s
        "wall_s": wall,
        "engine_share": clock.engine_s / max(clock.rollout_s, 1e-9),  # the rest: controller and round trips
        "worker_gap_share": clock.worker_gap_s / max(clock.rollout_s, 1e-9),  # of the rest: workers waiting for a call
        "controller_share": (clock.verify_s + clock.store_s + clock.dispatch_s) / max(clock.rollout_s, 1e-9),
        "prefill_step_frac": clock.prefill_calls / max(clock.engine_steps, 1),
        "steady_tokens_per_s": steady[0],
        "steady_samples_per_s": steady[1],
    }


def steady_rates(metrics: Path, after: int, samples_per_step: int) -> tuple[float, float]:
    """Rollout tokens/s and trained samples/s after the first `after` train steps: the run's cumulative figures at its
    last step less those at step `after` (samples/s over the wall clock between the two steps' records, training
    included). A fresh process (each Ray actor is one) pays its Triton compiles, GEMV timing and CUDA graph captures
    in its first steps; a long job pays them once, and the samples in flight when a short run stops are generated and
    never trained, which a long job trains at its next step: the steady rates are what a policy costs there."""
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "rollout/tokens_per_s" in r]
    if not steps:
        return float("nan"), float("nan")
    if after <= 0 or len(steps) <= after:  # 0: the whole run (tokens/s; samples/s needs a step to start from)
        last = steps[-1]
        return last["rollout/tokens_per_s"], float("nan")
    first, last = steps[after - 1], steps[-1]
    tokens = [r["rollout/tokens_per_s"] * r["time/rollout_s"] for r in (first, last)]
    tok_s = (tokens[1] - tokens[0]) / max(last["time/rollout_s"] - first["time/rollout_s"], 1e-9)
    return tok_s, (len(steps) - after) * samples_per_step / max(last["time"] - first["time"], 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes; under a minute on a 2-core CPU")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ray", action="store_true", help="run the worker as a Ray actor (default: in-process)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ffn", choices=["moe", "dense"], default="moe",
                    help="MoE 4 experts top-2 (default) or a dense MLP (the engine captures dense decode in CUDA graphs)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="run.dtype (default: the recipe's, float32)")
    ap.add_argument("--compile", choices=["auto", "layers", "ops", "off"], default="auto",
                    help="run.compile: the training forward under torch.compile (auto: on CUDA with bfloat16)")
    ap.add_argument("--prompts", type=int, default=32, help="groups per train step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=32, help="samples per forward/backward in the train step")
    ap.add_argument("--median", type=int, default=16)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--policies", default=",".join(POLICIES), help="the dispatch policies compared (comma-separated; "
                    "`sample` and `sync` at least)")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    ap.add_argument("--warmup", action="store_true", help="one untimed `sample` run first, which pays the process's "
                    "Triton compiles, GEMV timing and graph captures (otherwise the first arm does)")
    ap.add_argument("--steady-after", type=int, default=1, help="steady rollout tokens/s and trained samples/s: over the steps after this many (0: tokens/s over the whole run)")
    ap.add_argument("--repeats", type=int, default=1, help="run the arms this many times in turn (a b c a b c ...) and "
                    "report each figure's median over an arm's runs")
    ap.add_argument("--actor-vs-inprocess", action="store_true",
                    help="only `sample` dispatch, in-process and as a Ray actor with and without pipelined rollout calls")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="each run (the warm-up's too) in a new Python process, the in-process arm included: the "
                    "Triton disk cache the warm-up fills is shared, no arm runs in a process another run warmed")
    ap.add_argument("--one-run", help=argparse.SUPPRESS)  # POLICY:RAY:PIPELINED:TAG, the child of --fresh-processes
    ap.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--engine-ab", action="store_true", help="`sample` and `sync` in-process with neither engine.prefill_graphs "
                    "nor engine.overlap_steps, with each alone and with both (the default), in turn (on CPU: no graphs)")
    ap.add_argument("--prefill-intervals", help="only `sample` dispatch in-process at each engine.prefill_interval "
                    "given (comma-separated, e.g. 1,4)")
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.prompts, a.group, a.steps, a.median, a.max_tokens = 64, 2, 16, 4, 6, 8, 160
    if a.one_run:
        policy, ray, pipelined, tag = a.one_run.split(":")
        row = run(policy, a, Path(tempfile.mkdtemp(prefix="async_dispatch_")), ray=ray == "1", pipelined=pipelined == "1", tag=tag)
        a.row_json.write_text(json.dumps(row))
        return
    if a.fresh_processes and (a.engine_ab or a.prefill_intervals):
        ap.error("--fresh-processes: with the policies or --actor-vs-inprocess only, not --engine-ab or --prefill-intervals")
    out = Path(tempfile.mkdtemp(prefix="async_dispatch_"))
    runner = fresh_process_runner(out) if a.fresh_processes else run
    if a.warmup:
        runner("sample", a, out, tag="warmup")
    if a.actor_vs_inprocess:
        actor_vs_inprocess(a, out, runner)
        return
    if a.prefill_intervals:
        prefill_interval_sweep(a, out, [int(k) for k in a.prefill_intervals.split(",")])
        return
    if a.engine_ab:
        engine_ab(a, out)
        return
    policies = a.policies.split(",")
    if not {"sample", "sync"} <= set(policies) <= set(POLICIES):
        ap.error(f"--policies: `sample`, `sync` and any of {', '.join(POLICIES)}, comma-separated; got {a.policies!r}")
    by = in_turn({p: (lambda k, p=p: runner(p, a, out, tag=f"{p}_{k}")) for p in policies}, a.repeats)
    rows = list(by.values())
    cols = ["policy", "trained_samples_per_s", "gen_tokens_per_s", "concurrency_mean", "concurrency_std",
            "concurrency_held", "idle_frac", "reprefill_tokens", "interrupt_p99_steps", "rollout_s", "train_s",
            "weight_update_s", "steady_samples_per_s", "steady_tokens_per_s"]
    print(f"long-tail lengths: median {a.median}, sigma {a.sigma} (p99/p50 = {math.exp(2.326 * a.sigma):.1f}), "
          f"max {a.max_tokens}; {a.prompts}x{a.group} samples per step, {a.steps} steps; device {a.device}")
    print(" | ".join(c[:14].rjust(14) for c in cols))
    for r in rows:
        print(" | ".join((f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))[:14].rjust(14) for c in cols))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    sample, best_other = by["sample"], max((r for p, r in by.items() if p != "sample"), key=lambda r: r["steady_samples_per_s"])
    print(f"RESULT speedup_sample_vs_sync={sample['trained_samples_per_s'] / by['sync']['trained_samples_per_s']:.2f} "
          f"concurrency_held={sample['concurrency_held']:.3f} reprefill_tokens={sample['reprefill_tokens']} "
          f"interrupt_p99_steps={sample['interrupt_p99_steps']} "
          f"sample_over_best_other_samples_s={sample['trained_samples_per_s'] / max(r['trained_samples_per_s'] for p, r in by.items() if p != 'sample'):.3f} "
          f"steady_sample_over_best_other_samples_s={sample['steady_samples_per_s'] / best_other['steady_samples_per_s']:.3f} "
          f"sample_over_sync_tok_s={sample['gen_tokens_per_s'] / by['sync']['gen_tokens_per_s']:.2f} "
          f"steady_sample_over_sync_tok_s={sample['steady_tokens_per_s'] / by['sync']['steady_tokens_per_s']:.2f}")


def fresh_process_runner(out: Path):
    """`run` in a child Python process (this script with the same arguments and --one-run), its row read back from
    JSON: each run starts cold, as a Ray actor's process does, whether its worker is in-process or an actor."""
    args = [x for x in sys.argv[1:] if x not in ("--warmup", "--fresh-processes", "--actor-vs-inprocess")]

    def runner(policy: str, a, out_: Path, ray: bool | None = None, pipelined: bool = True, tag: str = "") -> dict:
        row_json = out / f"{tag}.json"
        ray = a.ray if ray is None else ray
        subprocess.run([sys.executable, __file__, *args, "--one-run", f"{policy}:{int(ray)}:{int(pipelined)}:{tag}",
                        "--row-json", str(row_json)], check=True)
        return json.loads(row_json.read_text())
    return runner


def actor_vs_inprocess(a, out: Path, runner=run) -> None:
    """Rollout tokens/s of `sample` dispatch with the PolicyWorker in-process and as a Ray actor, with and without
    pipelined rollout calls (GRPOStage.pipelined_calls), in turn (in one process, or each run in its own with
    --fresh-processes); interrupt latency in steps."""
    rows = in_turn({"inprocess": lambda k: runner("sample", a, out, ray=False, tag=f"inprocess_{k}"),
                    "actor_pipelined": lambda k: runner("sample", a, out, ray=True, tag=f"actor_pipelined_{k}"),
                    "actor_unpipelined": lambda k: runner("sample", a, out, ray=True, pipelined=False,
                                                          tag=f"actor_unpipelined_{k}")}, a.repeats)
    _print_rows(rows)
    base, steady = rows["inprocess"]["gen_tokens_per_s"], rows["inprocess"]["steady_tokens_per_s"]
    print(f"RESULT ray_over_inprocess_tok_s={rows['actor_pipelined']['gen_tokens_per_s'] / base:.3f} "
          f"ray_over_inprocess_train_s={rows['actor_pipelined']['train_s'] / rows['inprocess']['train_s']:.3f} "
          f"ray_over_inprocess_samples_s={rows['actor_pipelined']['trained_samples_per_s'] / rows['inprocess']['trained_samples_per_s']:.3f} "
          f"unpipelined_ray_over_inprocess_tok_s={rows['actor_unpipelined']['gen_tokens_per_s'] / base:.3f} "
          f"ray_interrupt_p99_steps={rows['actor_pipelined']['interrupt_p99_steps']} "
          f"unpipelined_ray_interrupt_p99_steps={rows['actor_unpipelined']['interrupt_p99_steps']} "
          f"inprocess_engine_share={rows['inprocess']['engine_share']:.3f} "
          f"ray_engine_share={rows['actor_pipelined']['engine_share']:.3f} "
          f"steady_ray_over_inprocess_tok_s={rows['actor_pipelined']['steady_tokens_per_s'] / steady:.3f} "
          f"steady_unpipelined_ray_over_inprocess_tok_s={rows['actor_unpipelined']['steady_tokens_per_s'] / steady:.3f}")


def prefill_interval_sweep(a, out: Path, intervals: list[int]) -> None:
    """`sample` dispatch in-process at each engine.prefill_interval, in turn in one process."""
    rows = in_turn({f"interval_{i}": (lambda k, i=i: run("sample", a, out, ray=False, tag=f"interval_{i}_{k}",
                                                         prefill_interval=i)) for i in intervals}, a.repeats)
    _print_rows(rows)
    print("RESULT " + " ".join(f"{name}_tok_s={r['gen_tokens_per_s']:.0f} {name}_prefill_step_frac={r['prefill_step_frac']:.3f} "
                               f"{name}_interrupt_p99_steps={r['interrupt_p99_steps']}" for name, r in rows.items()))


ENGINE_VARIANTS = {"base": {"prefill_graphs": False, "overlap_steps": False},
                   "prefill_graphs": {"prefill_graphs": True, "overlap_steps": False},
                   "overlap": {"prefill_graphs": False, "overlap_steps": True},
                   "both": {"prefill_graphs": True, "overlap_steps": True}}
"""--engine-ab: prefills from CUDA graphs and overlapped steps, each off and on (both on is the default on CUDA)."""


def engine_ab(a, out: Path) -> None:
    """`sample` and `sync` dispatch in-process under each of ENGINE_VARIANTS, in turn in one process."""
    rows = in_turn({f"{p}_{v}": (lambda k, p=p, v=v: run(p, a, out, ray=False, tag=f"{p}_{v}_{k}", engine=ENGINE_VARIANTS[v]))
                    for p in ("sample", "sync") for v in ENGINE_VARIANTS}, a.repeats)
    _print_rows(rows)
    tok = {name: r["gen_tokens_per_s"] for name, r in rows.items()}
    print("RESULT " + " ".join(
        f"sample_{v}_over_base_tok_s={tok[f'sample_{v}'] / tok['sample_base']:.3f} "
        f"sync_{v}_over_base_tok_s={tok[f'sync_{v}'] / tok['sync_base']:.3f} "
        f"sample_over_sync_tok_s_{v}={tok[f'sample_{v}'] / tok[f'sync_{v}']:.2f}" for v in ENGINE_VARIANTS))


def in_turn(arms: dict, repeats: int) -> dict[str, dict]:
    """Each arm (a function of the repeat's index returning a row) run `repeats` times in turn, a b c a b c ...,
    so that drift in the machine and the process's warm-up spread over the arms; each numeric figure is the median
    over an arm's runs (the row's other fields from its first run)."""
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for k in range(repeats):
        for name, arm in arms.items():
            runs[name].append(arm(k))
    def median(values: list):  # counts stay counts: the lower median, one of the runs' own
        return statistics.median_low(values) if all(isinstance(v, int) for v in values) else statistics.median(values)
    return {name: {key: median([r[key] for r in rs]) if isinstance(rs[0][key], (int, float)) else rs[0][key]
                   for key in rs[0]} for name, rs in runs.items()}


def _print_rows(rows: dict[str, dict]) -> None:
    for name, r in rows.items():
        print(f"{name:<18} rollout {r['gen_tokens_per_s']:>9.0f} tok/s ({r['steady_tokens_per_s']:.0f} steady)  trained {r['trained_samples_per_s']:>7.1f} samples/s  "
              f"interrupt p99 {r['interrupt_p99_steps']} steps  rollout {r['rollout_s']:.1f} s (engine share "
              f"{r['engine_share']:.2f}, verdicts + store + new prompts {r['controller_share']:.2f}; prefills in "
              f"{r['prefill_step_frac']:.2f} of steps)  train {r['train_s']:.1f} s (weight update {r['weight_update_s']:.2f} s)")


if __name__ == "__main__":
    main()
