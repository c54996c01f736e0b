"""KV-cache formats: storage cost, FP4 quantise/dequantise throughput, paged decode attention (issue #5).

    python bench/fp4_kv.py [--quick] [--device cuda] [--sweep] [--json out.json]

1. KV bytes per token per layer (K and V, all KV heads), seed §2.4.4:
       bf16 = 2 · KVH · D · 2
       fp8  = 2 · KVH · (D + 1)            E4M3 values + one E8M0 scale byte per row (model/fp8.py)
       fp4  = 2 · KVH · (D / 2 + D / 16)   4-bit E2M1 + one 8-bit E4M3 scale per 16 values,
                                           i.e. 4 + 8 / 16 = 4.5 bits per quantised value
2. On a GPU: the Triton quantise / dequantise throughput (bytes read + written per second) as a
   fraction of a plain device copy of the bf16 tensor measured in the same run (--sweep also times
   other launch shapes). On CPU the PyTorch reference is timed.
3. Decode attention (model/kernels/decode_attention.py), one query token per sequence over a paged
   cache with shuffled blocks, bf16 vs FP4 cache: time per decode step for one layer and per token
   (step / batch), and the KV bytes read per second. GPU: contexts 8K..128K; --quick on CPU: the
   Triton interpreter at small contexts (a smoke run, not a speed figure).
Last line: RESULT bits_per_value=.. kv_bytes_ratio_bf16_over_fp4=.. [quant_frac_of_copy=.. dequant_frac_of_copy=..
           attn_speedup_fp4_over_bf16_<ctx>=..]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from model import fp4 as ref  # noqa: E402
from model import fp8  # noqa: E402


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


def kv_bytes_per_token_per_layer(kv_heads: int, head_dim: int) -> dict[str, float]:
    return {
        "bf16": 2 * kv_heads * head_dim * 2,
        "fp8": 2 * kv_heads * fp8.bytes_per_row(head_dim),
        "fp4": 2 * kv_heads * (head_dim // 2 + head_dim // ref.BLOCK),
    }


def bench_quant(x: torch.Tensor, packed, scales, sweep: bool) -> dict:
    from model.kernels import fp4 as kern

    fp4_bytes = packed.numel() + scales.numel()
    p, s = kern.quantize(x)
    if kern.QUANT_V2 and not (torch.equal(p, packed) and torch.equal(s.view(torch.uint8), scales.view(torch.uint8))):
        print("WARNING: QUANT_V2 path not bit-exact, timing the previous PTX path")
        kern.QUANT_V2 = False
        p, s = kern.quantize(x)
    if kern.QUANT_ASM and not (torch.equal(p, packed) and torch.equal(s.view(torch.uint8), scales.view(torch.uint8))):
        print("WARNING: PTX encode not bit-exact, timing the Triton encode")
        kern.QUANT_ASM = False
        p, s = kern.quantize(x)
    assert torch.equal(p, packed) and torch.equal(s.view(torch.uint8), scales.view(torch.uint8)), "quantise not bit-exact"
    y = kern.dequantize(packed, scales, torch.bfloat16)
    assert torch.equal(y, ref.dequantize(packed, scales, torch.bfloat16)), "dequantise not bit-exact"
    out = torch.empty_like(x)
    iters = 20
    t_copy = _time(lambda: out.copy_(x), iters)
    bw_copy = 2 * x.numel() * 2 / t_copy
    moved = x.numel() * 2 + fp4_bytes

    def frac(fn):
        return moved / _time(fn, iters) / bw_copy

    res = {"copy_TBps": bw_copy / 1e12}
    if sweep:
        default = (kern.QUANT_NBP, kern.QUANT_WARPS, kern.DEQUANT_NBP, kern.DEQUANT_WARPS, kern.DEQUANT_F16_DECODE,
                   kern.QUANT_ASM, kern.QUANT_V2)
        for nbp, w in [(128, 4), (256, 4), (512, 4), (256, 8)]:  # quantise only (dequantise: goal met)
            kern.QUANT_NBP, kern.QUANT_WARPS = nbp, w
            fqs = []
            for qasm, v2 in ((False, False), (True, False), (True, True)):
                kern.QUANT_ASM, kern.QUANT_V2 = qasm, v2
                p2, s2 = kern.quantize(x)
                exact = torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
                fqs.append(frac(lambda: kern.quantize(x)) if exact else float("nan"))  # nan: not bit-exact
            print(f"  sweep NBP={nbp:4d} warps={w}: quantise {fqs[0]:.3f} (Triton encode) {fqs[1]:.3f} (PTX encode) "
                  f"{fqs[2]:.3f} (PTX V2) of copy")
            res[f"sweep_quant_nbp{nbp}_w{w}"] = fqs
        (kern.QUANT_NBP, kern.QUANT_WARPS, kern.DEQUANT_NBP, kern.DEQUANT_WARPS, kern.DEQUANT_F16_DECODE,
         kern.QUANT_ASM, kern.QUANT_V2) = default
    res["quant_frac_of_copy"] = frac(lambda: kern.quantize(x))
    res["dequant_frac_of_copy"] = frac(lambda: kern.dequantize(packed, scales, torch.bfloat16))
    print(f"copy {bw_copy / 1e12:.2f} TB/s (read + write); quantise {res['quant_frac_of_copy']:.3f} of copy, "
          f"dequantise {res['dequant_frac_of_copy']:.3f} of copy (bytes read + written / time)")
    return res


def _paged_kv(B: int, ctx: int, kvh: int, d: int, page: int, device: str, gen: torch.Generator):
    nb = -(-ctx // page)
    perm = torch.randperm(B * nb, generator=gen, device=device)
    table = perm.view(B, nb).int()
    k = torch.randn(B * nb * page, kvh, d, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(B * nb * page, kvh, d, generator=gen, device=device, dtype=torch.bfloat16)
    return k, v, table


def bench_attention(contexts: list[int], B: int, H: int, kvh: int, d: int, page: int, device: str, iters: int,
                    sweep: bool, sweep_contexts: tuple[int, ...] = ()) -> dict:
    from model.kernels.decode_attention import decode_attention

    gen = torch.Generator(device=device).manual_seed(0)
    per_tok = kv_bytes_per_token_per_layer(kvh, d)
    res = {}
    print(f"decode attention: B={B} sequences, H={H} query heads, KVH={kvh}, D={d}, page {page} tokens (shuffled)")
    print(f"{'context':>8} {'bf16 us/step':>13} {'fp4 us/step':>12} {'bf16 us/tok':>12} {'fp4 us/tok':>11} "
          f"{'bf16 TB/s':>10} {'fp4 TB/s':>9} {'speedup':>8}")
    for ctx in contexts:
        k, v, table = _paged_kv(B, ctx, kvh, d, page, device, gen)
        q = torch.randn(B, H, d, generator=gen, device=device, dtype=torch.bfloat16)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        fmt = ref
        if device == "cuda":
            from model.kernels import fp4 as fmt  # bit-exact with the reference, and fast at 128K
        k4, v4 = fmt.quantize(k), fmt.quantize(v)
        kd, vd = fmt.dequantize(*k4, torch.bfloat16), fmt.dequantize(*v4, torch.bfloat16)
        run16 = lambda **kw: decode_attention(q, k, v, table, lens, page, kv_format="dense", **kw)  # noqa: E731
        run4 = lambda **kw: decode_attention(q, k4, v4, table, lens, page, kv_format="fp4", **kw)  # noqa: E731
        # parity: fp4 kernel == dense kernel on the (exactly) dequantised cache, up to bf16 rounding of p
        o4 = run4()
        od = decode_attention(q, kd, vd, table, lens, page, kv_format="dense")
        err = (o4.float() - od.float()).abs().max().item()
        if err >= 2e-2 and device == "cuda":
            import model.kernels.decode_attention as da

            print(f"WARNING: fp4 decode {da.FP4_DECODE} mismatch {err}, timing decode 0")
            da.FP4_DECODE = 0
            o4 = run4()
            err = (o4.float() - od.float()).abs().max().item()
        assert err < 2e-2, f"fp4 vs dense-on-dequantised mismatch {err}"
        if sweep and ctx in sweep_contexts:
            # fp4 variants: decode (0 / 1 Triton 2-D / 3-D tile, 2 / 3 inline-PTX decode), scales as int32
            # words or bytes, tokens per tile, warps, split count (None: the default heuristic)
            import model.kernels.decode_attention as da

            for bn, w, splits in [(64, 4, None), (64, 4, 6), (64, 4, 8), (128, 4, None), (32, 4, None), (64, 2, None),
                                  (64, 4, 2)]:
                t16 = _time(lambda: run16(block_n=bn, num_warps=w, num_splits=splits), iters)
                print(f"  sweep ctx={ctx} bf16 block_n={bn} warps={w} splits={splits}: {t16 * 1e6:.1f} us")
                res[f"sweep_ctx{ctx}_bf16_bn{bn}_w{w}_s{splits}_us"] = t16 * 1e6
            words_default = da.FP4_SC_WORDS
            for dec, words, bn, w, splits in [
                (0, False, 128, 4, 5), (2, False, 128, 4, None), (2, False, 128, 4, 4), (2, True, 128, 4, None),
                (2, True, 128, 4, 5), (2, True, 128, 4, 8), (2, True, 128, 4, 12), (2, True, 64, 4, None),
                (2, True, 32, 4, None), (2, True, 64, 2, None), (2, True, 64, 4, 2), (2, True, 32, 2, None),
                (3, True, 64, 4, None), (0, False, 64, 4, None), (2, True, 64, 4, 4),
            ]:
                da.FP4_SC_WORDS = words
                o = run4(block_n=bn, num_warps=w, num_splits=splits, fp4_decode=dec)
                e = (o.float() - od.float()).abs().max().item()
                t4 = _time(lambda: run4(block_n=bn, num_warps=w, num_splits=splits, fp4_decode=dec), iters)
                print(f"  sweep ctx={ctx} fp4 decode={dec} words={words} block_n={bn} warps={w} splits={splits}: "
                      f"{t4 * 1e6:.1f} us (err {e:.1e})")
                res[f"sweep_ctx{ctx}_fp4_d{dec}_w{int(words)}_bn{bn}_w{w}_s{splits}_us"] = t4 * 1e6
            da.FP4_SC_WORDS = words_default
        t16, t4 = _time(run16, iters), _time(run4, iters)
        bw16, bw4 = B * ctx * per_tok["bf16"] / t16, B * ctx * per_tok["fp4"] / t4
        print(f"{ctx:8d} {t16 * 1e6:13.1f} {t4 * 1e6:12.1f} {t16 * 1e6 / B:12.2f} {t4 * 1e6 / B:11.2f} "
              f"{bw16 / 1e12:10.2f} {bw4 / 1e12:9.2f} {t16 / t4:8.2f}")
        res[str(ctx)] = dict(bf16_us_per_step=t16 * 1e6, fp4_us_per_step=t4 * 1e6, bf16_us_per_token=t16 * 1e6 / B,
                             fp4_us_per_token=t4 * 1e6 / B, bf16_TBps=bw16 / 1e12, fp4_TBps=bw4 / 1e12,
                             speedup=t16 / t4, parity_max_abs_err=err)
        k = v = k4 = v4 = kd = vd = None  # free the context's caches before the next one (lambdas above hold the names)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=1 << 20, help="tokens x kv heads for the quantise figures")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    ap.add_argument("--page", type=int, default=64, help="KV block size in tokens")
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes (GPU)")
    ap.add_argument("--sweep-contexts", default=None, help="contexts the attention sweep runs at (comma list)")
    ap.add_argument("--contexts", default=None, help="GPU: the contexts timed (comma list; default 8K..128K)")
    ap.add_argument("--no-quant", action="store_true", help="skip the quantise / dequantise figures")
    ap.add_argument("--no-attn", action="store_true", help="skip the decode attention figures")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gpu = a.device == "cuda"
    out: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "args": vars(a)}

    per_tok = kv_bytes_per_token_per_layer(a.kv_heads, a.head_dim)
    print(f"KV bytes per token per layer (KVH={a.kv_heads}, D={a.head_dim}): "
          + ", ".join(f"{k} {v:.0f}" for k, v in per_tok.items())
          + "   [bf16 2·KVH·D·2; fp8 2·KVH·(D+1); fp4 2·KVH·(D/2 + D/16)]")
    out["kv_bytes_per_token_per_layer"] = per_tok

    rows = 4096 if a.quick else a.rows
    x = torch.randn(rows, a.head_dim, device=a.device, dtype=torch.bfloat16)
    packed, scales = ref.quantize(x)
    fp4_bytes = packed.numel() + scales.numel()
    bits = 8 * fp4_bytes / x.numel()
    ratio = x.numel() * 2 / fp4_bytes
    print(f"{rows} rows x {a.head_dim}: bf16 {x.numel() * 2 / 2**20:.1f} MiB, fp4 {fp4_bytes / 2**20:.1f} MiB "
          f"({bits:.2f} bits/value, bf16/fp4 = {ratio:.3f}, fp8/fp4 = {per_tok['fp8'] / per_tok['fp4']:.3f})")
    extra = ""
    if gpu and not a.no_quant:
        q = bench_quant(x, packed, scales, a.sweep)
        out["quant"] = q
        extra = f" quant_frac_of_copy={q['quant_frac_of_copy']:.3f} dequant_frac_of_copy={q['dequant_frac_of_copy']:.3f}"
    else:
        t_q = _time(lambda: ref.quantize(x), 3)
        print(f"reference quantise on {a.device}: {x.numel() / t_q / 1e6:.1f} M values/s")
    x = packed = scales = None  # free before the attention part

    if gpu:
        contexts, B, H, kvh, d, page, iters = [8192, 16384, 32768, 65536, 131072], a.batch, a.q_heads, a.kv_heads, a.head_dim, a.page, 20
        if a.contexts:
            contexts = [int(c) for c in a.contexts.split(",")]
    else:  # interpreter smoke run: small shapes
        contexts, B, H, kvh, d, page, iters = [128, 512], 2, 8, 2, 64, 16, 1
    sweep_ctx = tuple(int(c) for c in a.sweep_contexts.split(",")) if a.sweep_contexts else (contexts[len(contexts) // 2],)
    attn = {} if a.no_attn else bench_attention(contexts, B, H, kvh, d, page, a.device, iters, a.sweep and gpu,
                                                sweep_ctx)
    out["attention"] = attn
    if a.no_attn:
        contexts = []
    extra += "".join(f" attn_speedup_fp4_over_bf16_{c // 1024 if c >= 1024 else c}{'k' if c >= 1024 else ''}="
                     f"{attn[str(c)]['speedup']:.2f}" for c in contexts)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"RESULT bits_per_value={bits:.2f} kv_bytes_ratio_bf16_over_fp4={ratio:.3f}{extra}")


if __name__ == "__main__":
    main()
