"""Paged decode attention (model/kernels/decode_attention.py) at the engine's shapes, timed as the decode graph runs
it: device time of one call replayed inside a CUDA graph (no launch or allocation overhead), bf16 and FP4 caches,
for the default launch and a sweep of tiles, warps, pipeline stages and split counts (issue #15: FP4 within 3% of
bf16 at every point, faster at 16K).

    python bench/paged_attention.py --quick   # CPU: the kernels interpreted on a tiny shape (parity, not speed)
    python bench/paged_attention.py           # CUDA: the Qwen3-0.6B attention shape (16 query / 8 KV heads, D 128)

Points (batch x context): b1, b64 and b256 with 128-384-token contexts in a 400-token block table (bench/engine.py's
decode: 128-token prompts, 256 new tokens), b64 at 2K and b16 at 16K (prompt fills the context). Pages of 16 tokens
in shuffled order. For each point and format it prints the default launch's us and the fastest sweep entries.
Last line: RESULT <point>_bf16_us=.. <point>_fp4_us=.. <point>_fp4_over_bf16=.. <point>_best_fp4_us=..
<point>_best_fp4=<block_n>/<warps>/<stages>/<splits> ...
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--quick" in sys.argv or not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from model.kernels import fp4  # noqa: E402
from model.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402

# name: (batch, min context, max context, block-table tokens)
POINTS = {"b1": (1, 128, 384, 400), "b64": (64, 128, 384, 400), "b256": (256, 128, 384, 400),
          "b64_2k": (64, 2048, 2048, 2048 + 80), "b16_16k": (16, 16384, 16384, 16384 + 80)}
H, KVH, D, PAGE = 16, 8, 128, 16
SWEEP = {  # (block_n, warps, stages) x splits (None: the default heuristic); each point stops at --budget-s
    "dense": list(itertools.product((64, 32, 128), (4, 2, 8), (None, 2))),
    "fp4": list(itertools.product((64, 128, 32), (4, 2, 8), (None, 3, 2))),
}
SPLITS = (None, 1, 2, 4, 8)


def _cache(batch: int, lo: int, hi: int, table_tokens: int, device: str, gen: torch.Generator):
    """Shuffled pages for `batch` sequences of lengths spread over [lo, hi], a table `table_tokens` wide."""
    blocks = -(-table_tokens // PAGE)
    perm = torch.randperm(batch * blocks, generator=gen, device=device)
    table = perm.view(batch, blocks).to(torch.int64)
    lens = torch.linspace(lo, hi, batch, device=device).round().to(torch.int32) if batch > 1 else \
        torch.full((1,), (lo + hi) // 2, dtype=torch.int32, device=device)
    k = torch.randn(batch * blocks * PAGE, KVH, D, generator=gen, device=device).to(torch.bfloat16)
    v = torch.randn(batch * blocks * PAGE, KVH, D, generator=gen, device=device).to(torch.bfloat16)
    q = torch.randn(batch, H, D, generator=gen, device=device).to(torch.bfloat16)
    return q, k, v, table, lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--points", default=",".join(POINTS), help="comma list of " + ", ".join(POINTS))
    ap.add_argument("--no-sweep", action="store_true", help="time the default launches only")
    ap.add_argument("--sweep-formats", default="dense,fp4", help="formats the sweep runs for (comma list)")
    ap.add_argument("--fp4-decodes", default="2", help="fp4 tile decodes to sweep (decode_attention FP4_DECODE: "
                    "0 / 1 Triton 2-D / 3-D tiles, 2 / 3 the same decoded by inline PTX)")
    ap.add_argument("--budget-s", type=float, default=40.0, help="seconds of sweep per point and format (compiles)")
    ap.add_argument("--fp4-kernels", default="triton", help="comma list of fp4 kernels timed at their default launch "
                    "(decode_attention fp4_kernel: triton, gluon); the first is the one swept and reported as fp4")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    if args.quick or not torch.cuda.is_available():  # interpreter: parity of both formats on a tiny shape
        q, k, v, table, lens = _cache(2, 5, 40, 48, "cpu", gen)
        k4, v4 = fp4.quantize(k), fp4.quantize(v)
        err = 0.0
        for fmt, kk, vv in (("dense", k, v), ("fp4", k4, v4)):
            for bn, splits in ((32, None), (64, 2)):
                out = decode_attention(q, kk, vv, table, lens, PAGE, kv_format=fmt, block_n=bn, num_splits=splits)
                ref = decode_attention_ref(q, kk, vv, table, lens, PAGE, kv_format=fmt)
                err = max(err, (out.float() - ref.float()).abs().max().item())
        print(f"interpreted, 2 sequences of 5-40 tokens: max |kernel - reference| {err:.2e} (bf16 output)")
        print(f"RESULT max_abs_err={err:.3g}")
        return

    from model.kernels.gemv import graph_us

    result: dict[str, object] = {}
    fp4_first = args.fp4_kernels.split(",")[0]
    for name in args.points.split(","):
        batch, lo, hi, table_tokens = POINTS[name]
        q, k, v, table, lens = _cache(batch, lo, hi, table_tokens, "cuda", gen)
        caches = {"dense": (k, v), "fp4": (fp4.quantize(k), fp4.quantize(v))}
        del k, v
        default = {}
        for fmt, (kk, vv) in caches.items():
            def run(**kw):
                if fmt == "fp4":
                    kw.setdefault("fp4_kernel", fp4_first)
                return decode_attention(q, kk, vv, table, lens, PAGE, kv_format=fmt, **kw)

            default[fmt] = graph_us(run)
            timed, t0 = [], time.monotonic()
            if not args.no_sweep and fmt in args.sweep_formats.split(","):
                decodes = [int(x) for x in args.fp4_decodes.split(",")] if fmt == "fp4" else [None]
                for dec, (bn, w, st), splits in itertools.product(decodes, SWEEP[fmt], SPLITS):
                    if time.monotonic() - t0 > args.budget_s:
                        print(f"  {name} {fmt}: sweep budget spent after {len(timed)} launches")
                        break
                    tag = f"{bn}/{w}/{st}/{splits}" + (f"/decode{dec}" if len(decodes) > 1 else "")
                    try:
                        us = graph_us(lambda: run(block_n=bn, num_warps=w, num_stages=st, num_splits=splits,
                                                  **({"fp4_decode": dec} if dec is not None else {})))
                    except Exception as e:  # noqa: BLE001  (a launch the device cannot hold: out of shared memory)
                        print(f"  {name} {fmt} {tag}: {type(e).__name__}")
                        continue
                    timed.append((us, tag))
                timed.sort()
                if timed:
                    result[f"{name}_best_{fmt}_us"] = round(timed[0][0], 2)
                    result[f"{name}_best_{fmt}"] = timed[0][1]
            print(f"{name} {fmt}: {len(timed)} timed; default {default[fmt]:.2f} us; best " +
                  ", ".join(f"{c} {us:.2f}" for us, c in timed[:6]))
            result[f"{name}_{fmt if fmt == 'fp4' else 'bf16'}_us"] = round(default[fmt], 2)
        result[f"{name}_fp4_over_bf16"] = round(default["fp4"] / default["dense"], 3)
        for kernel in args.fp4_kernels.split(",")[1:]:  # the others at their default launch, beside the first
            kk, vv = caches["fp4"]
            out = decode_attention(q, kk, vv, table, lens, PAGE, kv_format="fp4", fp4_kernel=kernel)
            first = decode_attention(q, kk, vv, table, lens, PAGE, kv_format="fp4", fp4_kernel=fp4_first)
            us = graph_us(lambda: decode_attention(q, kk, vv, table, lens, PAGE, kv_format="fp4", fp4_kernel=kernel))
            diff = (out.float() - first.float()).abs().max().item()
            print(f"{name} fp4 {kernel}: default {us:.2f} us; max |{kernel} - {fp4_first}| {diff:.3g}")
            result[f"{name}_fp4_{kernel}_us"] = round(us, 2)
            result[f"{name}_fp4_{kernel}_over_bf16"] = round(us / default["dense"], 3)
            result[f"{name}_fp4_{kernel}_max_diff"] = round(diff, 4)
        del caches
        torch.cuda.empty_cache()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
