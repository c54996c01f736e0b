"""The skinny decode GEMV (model/kernels/gemv.py) against cuBLAS (F.linear), per linear layer of a decode step
(issue #15): device time of one call inside a CUDA graph, for every tile of a wide sweep, at 1, 2 and 4 rows.

    python bench/gemv.py --quick    # CPU: the kernel interpreted on a small shape against F.linear (max error)
    python bench/gemv.py            # CUDA: the Qwen3-0.6B and SmolLM2-135M shapes' linears, bf16

Per shape it prints cuBLAS's us, the best tile's us and the tiles within 5% of it, and the fraction of the
memory roofline (weight bytes / 4.2 TB/s, the copy bandwidth measured on the H200) each reaches.
Last line: RESULT [max_abs_err=..] | [<shape>_m<M>_cublas_us=.. <shape>_m<M>_kernel_us=.. ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--quick" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.kernels import gemv  # noqa: E402

SHAPES = {  # name: (K, N) of the decode step's linears
    "qwen3_qkv": (1024, 4096), "qwen3_o": (2048, 1024), "qwen3_gate_up": (1024, 6144), "qwen3_down": (3072, 1024),
    "qwen3_head": (1024, 151936),
    "smollm2_qkv": (576, 960), "smollm2_o": (576, 576), "smollm2_gate_up": (576, 3072), "smollm2_down": (1536, 576),
    "smollm2_head": (576, 49152),
}
SWEEP = [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (1, 2, 4))
         if bn * bk // (32 * w) <= 128]
COPY_TB_S = 4.2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick or not torch.cuda.is_available():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 300, generator=g).to(torch.bfloat16)
        w = (torch.randn(70, 300, generator=g) / 17).to(torch.bfloat16)
        err = (gemv.gemv(x, w).float() - F.linear(x.float(), w.float())).abs().max().item()
        print(f"interpreted 2x300 -> 70: max |kernel - F.linear in float32| {err:.2e}")
        print(f"RESULT max_abs_err={err:.3g}")
        return
    result = {}
    for name, (K, N) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda") / K**0.5).to(torch.bfloat16)
        roof = N * K * 2 / (COPY_TB_S * 1e6)
        for m in (1, 2, 4):
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            cublas = gemv.graph_us(lambda: F.linear(x, w))
            timed = sorted((gemv.graph_us(lambda c=c: gemv.gemv(x, w, None, c)), c) for c in SWEEP)
            best = timed[0][0]
            near = [c for t, c in timed if t <= best * 1.05]
            print(f"{name:<16} M={m}: cuBLAS {cublas:6.2f} us ({roof / cublas:4.0%} of roofline), kernel {best:6.2f} us "
                  f"({roof / best:4.0%}) at {timed[0][1]}; within 5%: {near[:6]}; in CONFIGS: "
                  f"{min(t for t, c in timed if c in gemv.CONFIGS):.2f} us", flush=True)
            result[f"{name}_m{m}_cublas_us"], result[f"{name}_m{m}_kernel_us"] = cublas, best
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
