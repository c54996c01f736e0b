"""Where a decode step's time goes (issue #15): the device time of one graph replay against the wall time of a
whole engine step (host work included), and the eager step's kernels by total device time.

    python bench/decode_profile.py --quick      # CPU, tiny shape: the plumbing (no graphs there)
    python bench/decode_profile.py              # CUDA: the Qwen3-0.6B shape at batch 1 and 64

Random bf16 weights, 128-token prompts. `replay_ms`: CUDA-event time of `graph.replay()` alone (the step's
forward); `step_ms`: wall time of `Engine.step()` in steady decode; `host_ms` = step_ms - replay_ms (input
copies, sampling, the token read, Python bookkeeping). The table lists the eager forward's kernels by
device time (torch.profiler), the kernel count per step, and the share of the top kernels.
Then (CUDA) the kernels the decode graph itself holds, at batch 1 and 64, by device time.
Last line: RESULT replay_ms_b1=.. step_ms_b1=.. host_ms_b1=.. replay_ms_b64=.. step_ms_b64=.. host_ms_b64=..
kernels_per_step=.. (the eager step's) [graph_kernels_b1=.. graph_kernels_b64=..]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import build  # noqa: E402  (bench/engine.py: the shapes)

from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.types import GenerationRequest  # noqa: E402


def steady_engine(model, batch: int, prompt: int, device: str, graphs: bool) -> Engine:
    eng = Engine(model, EngineConfig(max_batch_size=batch, block_size=16, max_seq_len=prompt + 512, max_new_tokens=480,
                                     cuda_graphs=graphs), eos_id=0, device=device)
    g = torch.Generator().manual_seed(0)
    eng.add([GenerationRequest(f"r{i}", tuple(torch.randint(1, model.config.vocab_size, (prompt,), generator=g).tolist()),
                               480, seed=i, ignore_eos=True) for i in range(batch)])
    for _ in range(8):  # prefill, graph capture, warm-up
        eng.step()
    return eng


def measure(model, batch: int, prompt: int, device: str, steps: int) -> dict[str, float]:
    eng = steady_engine(model, batch, prompt, device, graphs=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    replay_ms = float("nan")
    graph = eng.graphs.captured(batch) if eng.graphs is not None else None
    if graph is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        end.synchronize()
        replay_ms = start.elapsed_time(end) / steps
    return {"step_ms": step_ms, "replay_ms": replay_ms, "host_ms": step_ms - replay_ms}


def kernel_table(model, batch: int, prompt: int, device: str) -> int:
    """Profile one eager decode forward; print kernels by device time; return the kernel count."""
    from torch.profiler import ProfilerActivity, profile

    eng = steady_engine(model, batch, prompt, device, graphs=False)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if (e.device_type.name == "CUDA") == (device == "cuda")]
    if device != "cuda":
        evs = [e for e in evs if e.name.startswith("aten::")]
    by: dict[str, list[float]] = {}
    for e in evs:
        by.setdefault(e.name[:90], []).append(e.device_time if device == "cuda" else e.cpu_time)
    total = sum(sum(v) for v in by.values())
    print(f"eager step at batch {batch}: {len(evs)} {'kernels' if device == 'cuda' else 'aten ops'}, {total / 1000:.2f} ms "
          f"{'device' if device == 'cuda' else 'cpu'} time")
    for name, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"  {sum(ts) / 1000:8.3f} ms {len(ts):5d}x  {name}")
    return len(evs)


def graph_kernel_table(model, batch: int, prompt: int) -> int:
    """The kernels the decode graph holds, by device time: its captured computation (rollout/graphs.py `_forward`,
    the rollout path: fused projections, the paged decode kernel, the in-graph sampler) run once more eagerly on
    the graph's own input buffer under the profiler (it rewrites the K/V the last step wrote, with the same values);
    returns their count. The eager table above is the engine without graphs, a different (unfused) forward."""
    from torch.profiler import ProfilerActivity, profile

    eng = steady_engine(model, batch, prompt, "cuda", graphs=True)
    with torch.no_grad():
        eng.graphs.forward_eagerly(batch)  # warm (lazy inits outside the profile)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.graphs.forward_eagerly(batch)
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by: dict[str, list[float]] = {}
    for e in evs:
        by.setdefault(e.name[:90], []).append(e.device_time)
    total = sum(sum(v) for v in by.values())
    layers = model.config.num_layers
    print(f"graph step at batch {batch}: {len(evs)} kernels ({len(evs) / layers:.1f} per layer), {total / 1000:.3f} ms of "
          f"kernel time run one by one")
    for name, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"  {sum(ts) / 1000:8.3f} ms {len(ts):5d}x  {sum(ts) / len(ts):7.1f} us each  {name}")
    return len(evs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--kv", default="bf16", choices=["bf16", "fp8", "fp4"], help="the KV cache's storage format")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    shape, prompt, steps = ("tiny", 16, 20) if device == "cpu" else (args.shape, 128, 200)
    model = build(shape, device, args.kv)
    result = {}
    for b in (1, 64):
        m = measure(model, b, prompt, device, steps)
        print(f"{shape} batch {b}: step {m['step_ms']:.3f} ms, graph replay {m['replay_ms']:.3f} ms, host {m['host_ms']:.3f} ms",
              flush=True)
        result.update({f"{k.removesuffix('_ms')}_ms_b{b}": v for k, v in m.items()})
    result["kernels_per_step"] = kernel_table(model, 64, prompt, device)
    if device == "cuda":
        for b in (1, 64):
            result[f"graph_kernels_b{b}"] = graph_kernel_table(model, b, prompt)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
