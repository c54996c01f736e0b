"""Teacher switching cost: 48 heterogeneous teachers through a TeacherPool (seed §5.2.4, "negligible cost").

    python bench/teacher_pool.py [--quick] [--device cuda] [--teachers 48] [--resident 12]

Builds `--teachers` random-init teachers cycling over the five architectures of
teachers/architectures.py (dense narrow-deep, dense wide-shallow, MoE, MQA, no-qk-norm tied), scaled
by `--width`, and a stream of train steps each scoring one batch for `--per-step` teachers drawn at
random (the OPD batch grouped by teacher). The same step stream runs in five modes, interleaved over
`--repeats` rounds:

    resident    every teacher already on the device (budget = all): teacher compute alone
    sync        budget = `--resident` teachers, loads on demand, no prefetch
    prefetch    same budget, the next teacher copied in while the current one computes
    lookahead   prefetch, and the driver passes each step the next step's teachers
                (`run(..., next_teachers=...)`), so a step's first load starts during the previous step

    control    `resident` again: its "overhead" is the noise floor of the measurement

switch_overhead = median over rounds of (step time of a mode / step time of `resident` - 1), each
round's modes running the same steps side by side, in an order rotated every round (so that no mode
always runs first, or right after another). The pool's own counters (loads per step, load wait /
compute) are printed too: they measure the switching cost directly, without the noise of step times.
Last line: RESULT teachers=<n> switch_overhead=<prefetch mode's fraction> switch_overhead_lookahead=<lookahead's>
noise=<control's>
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import ModelConfig  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from teachers.pool import TeacherPool  # noqa: E402
from teachers.architectures import ARCHITECTURES  # noqa: E402


def scaled(cfg: ModelConfig, width: int, extra_layers: int) -> ModelConfig:
    """The architecture with `width` times the heads, KV heads and FFN width (head_dim kept)."""
    ffn = cfg.ffn.model_copy(update={"moe_intermediate_size": cfg.ffn.moe_intermediate_size * width} if cfg.is_moe
                             else {"intermediate_size": cfg.ffn.intermediate_size * width})
    return cfg.model_copy(update=dict(hidden_size=cfg.hidden_size * width, num_heads=cfg.num_heads * width,
                                      num_kv_heads=cfg.num_kv_heads * width, num_layers=cfg.num_layers + extra_layers,
                                      ffn=ffn))


def make_zoo(n: int, width: int, device: str, dtype: torch.dtype, seed: int) -> list[tuple[str, ModelConfig, dict]]:
    """n teachers (distinct depth per lap over the architectures), weights drawn on `device`, returned on CPU."""
    archs = list(ARCHITECTURES.items())
    zoo = []
    for i in range(n):
        arch, base = archs[i % len(archs)]
        cfg = scaled(base, width, extra_layers=(i // len(archs)) % 3)
        torch.manual_seed(seed + i)
        with torch.device(device):
            model = Decoder(cfg).to(dtype)
        zoo.append((f"t{i:02d}-{arch}", cfg, {k: v.cpu() for k, v in model.state_dict().items()}))
        del model
    return zoo


def step_stream(names: list[str], steps: int, per_step: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [rng.sample(names, per_step) for _ in range(steps)]


def run_steps(pool: TeacherPool, steps: list[list[str]], batch: torch.Tensor, lookahead: bool = False,
              then: list[str] | None = None) -> float:
    """Seconds for the steps; each teacher's `fn` reduces its logits' max like an OPD loss would touch them.
    lookahead: each step is told the next one's teachers (the last step: `then`)."""
    sink = []

    def score(_name, out):
        sink.append((out.hidden[:, -1] @ out.head_weight.t()).amax())

    sync = torch.cuda.synchronize if batch.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i, names in enumerate(steps):
        nxt = (steps[i + 1] if i + 1 < len(steps) else then or []) if lookahead else []
        pool.run({n: batch for n in names}, score, next_teachers=nxt)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke size: under a minute")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--teachers", type=int, default=48)
    ap.add_argument("--resident", type=int, default=12, help="device budget, in teachers of median size")
    ap.add_argument("--per-step", type=int, default=6, help="teachers touched per train step")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode and round")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds over the modes")
    ap.add_argument("--width", type=int, default=None, help="architecture width multiplier (CPU 1, GPU 8)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per teacher batch (CPU 8, GPU 32)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (CPU 48, GPU 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch intra-op threads (the prefetch thread "
                    "copies alongside; 1 also keeps timings stable on shared cores)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    width = a.width or (8 if cuda else 1)
    batch_size, seq = a.batch or (32 if cuda else 4 if a.quick else 8), a.seq or (512 if cuda else 48)
    steps_n = a.steps or (6 if a.quick else 20)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(a.threads)

    t0 = time.perf_counter()
    zoo = make_zoo(a.teachers, width, a.device, dtype, a.seed)
    sizes = sorted(sum(t.numel() * t.element_size() for t in state.values()) for _, _, state in zoo)
    median = sizes[len(sizes) // 2]
    budget_mib = max(a.resident * median, 2 * sizes[-1]) / 2**20
    all_mib = 1.05 * sum(sizes) / 2**20
    pool = TeacherPool([], all_mib, prefetch=False, device=a.device)
    for name, cfg, state in zoo:
        pool.add_weights(name, cfg, state)
    del zoo
    modes = {"resident": (all_mib, False), "sync": (budget_mib, False), "prefetch": (budget_mib, True),
             "lookahead": (budget_mib, True), "control": (all_mib, False)}
    names = pool.names
    params = [pool.config(n) for n in names]
    print(f"{len(names)} teachers on {a.device} ({dtype}): {sizes[0] / 2**20:.1f}-{sizes[-1] / 2**20:.1f} MiB each "
          f"(hidden {min(c.hidden_size for c in params)}-{max(c.hidden_size for c in params)}, "
          f"layers {min(c.num_layers for c in params)}-{max(c.num_layers for c in params)}, "
          f"{sum(c.is_moe for c in params)} MoE); budget {budget_mib:.0f} MiB = ~{a.resident} teachers; "
          f"{a.per_step} teachers/step x {batch_size}x{seq} tokens; built in {time.perf_counter() - t0:.1f} s")

    batch = torch.randint(3, 99, (batch_size, seq), device=a.device)
    all_at_once = [names[i:i + a.per_step] for i in range(0, len(names), a.per_step)]

    def enter(mode: str, first: list[str] | None = None) -> None:
        """Switch the one pool to a mode and warm it: every teacher resident, or a steady LRU state
        (lookahead: the last warm step announces `first`, the first timed step, as a running loop would)."""
        mib, prefetch = modes[mode]
        pool.set_budget(mib)
        pool.set_prefetch(prefetch)
        warm = all_at_once if mode in ("resident", "control") else step_stream(names, 2 if a.quick else 4, a.per_step, a.seed + 1)
        run_steps(pool, warm, batch, lookahead=mode == "lookahead", then=first)
        pool.stats()

    enter("resident")
    run_steps(pool, all_at_once, batch)  # first-use costs (kernels, allocator) out of every timed round
    times: dict[str, list[float]] = {m: [] for m in modes}
    counters: dict[str, list] = {m: [] for m in modes}
    for r in range(a.repeats):
        steps = step_stream(names, steps_n, a.per_step, a.seed + 100 + r)
        order = list(modes)
        for mode in order[r % len(order):] + order[:r % len(order)]:
            enter(mode, steps[0])
            times[mode].append(run_steps(pool, steps, batch, lookahead=mode == "lookahead") / steps_n)
            counters[mode].append(pool.stats())
    rows = {}
    print(f"\n{'mode':10s} {'step ms':>9s} {'overhead':>9s} {'compute ms':>11s} {'loads/step':>11s} {'prefetched':>11s} "
          f"{'wait/compute':>13s} {'load ms':>8s}")
    for mode in modes:
        st = statistics.median(times[mode])
        overhead = statistics.median(t / b - 1 for t, b in zip(times[mode], times["resident"]))
        cs = counters[mode]
        loads = sum(c.loads for c in cs) / (steps_n * a.repeats)
        pre = sum(c.prefetched for c in cs) / max(1, sum(c.loads for c in cs))
        wait = sum(c.load_wait_s for c in cs) / sum(c.compute_s for c in cs)
        load_ms = 1e3 * sum(c.load_s for c in cs) / max(1, sum(c.loads for c in cs))
        compute_ms = 1e3 * sum(c.compute_s for c in cs) / (steps_n * a.repeats)
        rows[mode] = dict(step_ms=1e3 * st, overhead=overhead, compute_ms_per_step=compute_ms, loads_per_step=loads,
                          prefetched_frac=pre, wait_over_compute=wait, ms_per_load=load_ms,
                          step_ms_rounds=[1e3 * t for t in times[mode]],
                          overhead_rounds=[t / b - 1 for t, b in zip(times[mode], times["resident"])])
        print(f"{mode:10s} {1e3 * st:9.2f} {overhead:9.3f} {compute_ms:11.2f} {loads:11.2f} {pre:11.2f} "
              f"{wait:13.4f} {load_ms:8.2f}")
    pool.close()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(args=vars(a), device=a.device, width=width, batch=batch_size, seq=seq,
                                                budget_mib=budget_mib, teacher_mib=[s / 2**20 for s in sizes],
                                                modes=rows), indent=2))
    print(f"RESULT teachers={len(names)} switch_overhead={rows['prefetch']['overhead']:.4f} "
          f"switch_overhead_lookahead={rows['lookahead']['overhead']:.4f} noise={rows['control']['overhead']:.4f}")


if __name__ == "__main__":
    main()
