"""FP4 KV format: storage cost and quantise/dequantise throughput (issue #5, first figures).

    python bench/fp4_kv.py [--quick] [--device cuda]

Bits per value (4-bit E2M1 + one 8-bit E4M3 scale per 16 values), the KV bytes ratio bf16 / fp4, and
on a GPU the Triton kernels' throughput (bytes read + written per second) as a fraction of a plain
device copy of the bf16 tensor measured in the same run. On CPU the PyTorch reference is timed.
Last line: RESULT bits_per_value=.. kv_bytes_ratio_bf16_over_fp4=.. [quant_frac_of_copy=.. dequant_frac_of_copy=..]
"""

from __future__ import annotations

import argparse
import time

import torch

from model import fp4 as ref


def _time(fn, iters: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=1 << 20, help="tokens x kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    rows = 4096 if a.quick else a.rows
    x = torch.randn(rows, a.head_dim, device=a.device, dtype=torch.bfloat16)
    packed, scales = ref.quantize(x)
    fp4_bytes = packed.numel() + scales.numel()
    bits = 8 * fp4_bytes / x.numel()
    ratio = x.numel() * 2 / fp4_bytes
    print(f"{rows} rows x {a.head_dim}: bf16 {x.numel() * 2 / 2**20:.1f} MiB, fp4 {fp4_bytes / 2**20:.1f} MiB "
          f"({bits:.2f} bits/value, bf16/fp4 = {ratio:.3f})")
    extra = ""
    if a.device == "cuda":
        from model.kernels import fp4 as kern

        p, s = kern.quantize(x)
        assert torch.equal(p, packed) and torch.equal(s.view(torch.uint8), scales.view(torch.uint8))
        y = torch.empty_like(x)
        iters = 20
        t_copy = _time(lambda: y.copy_(x), iters)
        t_q = _time(lambda: kern.quantize(x), iters)
        t_d = _time(lambda: kern.dequantize(packed, scales, torch.bfloat16), iters)
        moved_copy, moved_q = 2 * x.numel() * 2, x.numel() * 2 + fp4_bytes
        bw_copy, bw_q, bw_d = moved_copy / t_copy, moved_q / t_q, moved_q / t_d
        print(f"copy {bw_copy / 1e12:.2f} TB/s; quantise {bw_q / 1e12:.2f} TB/s ({bw_q / bw_copy:.2f} of copy); "
              f"dequantise {bw_d / 1e12:.2f} TB/s ({bw_d / bw_copy:.2f} of copy)")
        extra = f" quant_frac_of_copy={bw_q / bw_copy:.3f} dequant_frac_of_copy={bw_d / bw_copy:.3f}"
    else:
        t_q = _time(lambda: ref.quantize(x), 3)
        print(f"reference quantise on {a.device}: {x.numel() / t_q / 1e6:.1f} M values/s")
    print(f"RESULT bits_per_value={bits:.2f} kv_bytes_ratio_bf16_over_fp4={ratio:.3f}{extra}")


if __name__ == "__main__":
    main()
