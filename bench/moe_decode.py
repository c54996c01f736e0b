"""Routed experts at decode batch sizes: the expert loop (`ExpertBank.loop`, a GEMM pair per expert with
tokens and a host read of the counts) vs the grouped kernels (model/kernels/moe.py), side by side in one run,
and the grouped kernels' time inside a captured CUDA graph (which the loop cannot be: it reads the host).

    python bench/moe_decode.py --quick          # CPU, tiny shape, kernels interpreted: the plumbing, < 1 min
    python bench/moe_decode.py                  # GPU: Qwen3-30B-A3B's MoE layer (128 experts, top 8, d 2048, f 768)

Per batch size: ms per layer call (median of `--iters`), the max |difference| of the two outputs relative to
the output's scale, and the weights' memory-roofline time (every expert hit is read once; at decode batch
sizes nearly all are). Last line: RESULT shape=.. batches=<b1>,.. loop_ms=<..> grouped_ms=<..>
graph_ms=<.. or nan> speedup=<loop/grouped at the largest batch>
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"qwen3_moe": dict(E=128, k=8, d=2048, f=768), "tiny": dict(E=8, k=2, d=64, f=48)}


def timed(fn, iters: int, cuda: bool) -> float:
    import torch

    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3_moe")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if a.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.shape, a.batches, a.iters = "tiny", "1,4", 2
    import torch

    from model.decoder import ExpertBank
    from model.kernels.moe import moe_experts

    cuda = torch.cuda.is_available() and not a.quick
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    s = SHAPES[a.shape]
    torch.manual_seed(0)
    bank = ExpertBank(s["E"], s["d"], s["f"])
    for p in bank.parameters():
        torch.nn.init.normal_(p, std=s["d"] ** -0.5)
    bank = bank.to(dev, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in bank.parameters())
    rows = []
    with torch.no_grad():
        for n in [int(b) for b in a.batches.split(",")]:
            x = torch.randn(n, s["d"], device=dev, dtype=dtype)
            ids = torch.stack([torch.randperm(s["E"], device=dev)[: s["k"]] for _ in range(n)])
            w = torch.rand(n, s["k"], device=dev)
            hit = ids.unique().numel() / s["E"]
            loop = timed(lambda: bank.loop(x, ids, w), a.iters, cuda)
            grouped = timed(lambda: moe_experts(x, ids, w, bank.gate_proj, bank.up_proj, bank.down_proj), a.iters, cuda)
            want, got = bank.loop(x, ids, w).float(), moe_experts(x, ids, w, bank.gate_proj, bank.up_proj, bank.down_proj).float()
            diff = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-9)
            graph = float("nan")
            if cuda:
                g = torch.cuda.CUDAGraph()
                out = moe_experts(x, ids, w, bank.gate_proj, bank.up_proj, bank.down_proj)  # warm (compile) first
                with torch.cuda.graph(g):
                    out = moe_experts(x, ids, w, bank.gate_proj, bank.up_proj, bank.down_proj)
                graph = timed(g.replay, a.iters, cuda)
                assert torch.equal(out, moe_experts(x, ids, w, bank.gate_proj, bank.up_proj, bank.down_proj))
            roofline = weight_bytes * hit / 4.2e12 * 1e3  # H200 copy bandwidth measured here: 4.2 TB/s
            rows.append((n, loop, grouped, graph, diff, roofline))
            print(f"batch {n:4d}: loop {loop:8.3f} ms  grouped {grouped:8.3f} ms  graph {graph:8.3f} ms  "
                  f"rel diff {diff:.1e}  experts hit {hit:.2f}  weights roofline {roofline:.3f} ms", flush=True)
    last = rows[-1]
    print(f"RESULT shape={a.shape} batches={','.join(str(r[0]) for r in rows)} "
          f"loop_ms={','.join('%.3f' % r[1] for r in rows)} grouped_ms={','.join('%.3f' % r[2] for r in rows)} "
          f"graph_ms={','.join('%.3f' % r[3] for r in rows)} speedup={last[1] / last[2]:.2f}")


if __name__ == "__main__":
    main()
