"""Instruction mix of the paged decode-attention kernel as compiled for the H200 (sm_90), bf16 against FP4 KV (issue
#15), on any machine: Triton compiles for a GPU target without a GPU (its wheel ships ptxas and cuobjdump), so the
kernel's shared-memory traffic can be read off its TTGIR and SASS on this CPU.

    python bench/kernel_isa.py --quick                 # the engine's short-context launch, bf16 and FP4 (decode 2)
    python bench/kernel_isa.py --fp4-decodes 0,2,3 --block-n 64,128 [--dump DIR]

The Qwen3-0.6B attention shape (16 query / 8 KV heads, head_dim 128, 16-token pages), each argument specialised as
the launch specialises it (pointers and strides divisible by 16). Per variant: SASS counts of async global->shared
copies (LDGSTS), shared stores (STS*), ldmatrix (LDSM*), other shared loads (LDS*), global loads (LDG*), HMMA and the
nibble decode's PRMT / LOP3 / HMUL2, and `smem_tiles`: the TTGIR `local_alloc`s of a register tile of at least
BLOCK_N rows, each a tile written to shared memory and read back to reach the tensor-core operand layout (bf16's
K and V tiles arrive in shared memory by async copy instead; FP4's decoded halves take this trip: BENCHMARKS.md).
The figures are Triton's version here (the H200 image has another): a relative reading, not the device's code.
Last line: RESULT bf16_sts=.. bf16_lds=.. bf16_smem_tiles=.. fp4_sts=.. fp4_lds=.. fp4_smem_tiles=.. ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAMILIES = ("LDGSTS", "STS", "LDSM", "LDS", "LDG", "HMMA", "PRMT", "LOP3", "HMUL2")
"""Opcode families counted (an opcode counts under the first family its name starts with, then its dot-suffix)."""
SHAPE = {"H": 16, "G": 2, "G_PAD": 16, "D": 128, "PAGE": 16}


def sass_counts(sass: str) -> Counter:
    """Instructions per family in `cuobjdump -sass` text ("/*0120*/  @!P0 LDGSTS.E.BYPASS.128 [R1], ..." counts as
    LDGSTS; STSM counts as STS, LDSM as LDSM, not LDS)."""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    out: Counter = Counter()
    for op in ops:
        family = next((f for f in FAMILIES if op == f or op.startswith(f) and op[len(f):] in ("", "M", "U")), None)
        if family is not None:
            out[family] += 1
    out["all"] = len(ops)
    return out


def smem_tiles(ttgir: str, block_n: int) -> int:
    """TTGIR `local_alloc`s of a register tensor with at least `block_n` rows: tiles written to shared memory from
    registers (async copies allocate their buffers without a source and do not count)."""
    rows = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<(\d+)x", ttgir)
    # Gluon states its conversions: a blocked register tile converted to an operand layout goes through shared memory
    # (the Gluon kernel's K tile arrives from a linear layout, asserted trivial; its V tile takes the trip)
    rows += re.findall(r"ttg\.convert_layout %\S+ : tensor<(\d+)x\d+x\w+, #blocked\d*> -> tensor<[^>]*dot_op", ttgir)
    return sum(int(r) >= block_n for r in rows)


def compile_variant(fmt: int, block_n: int, num_stages: int | None, fp4_decode: int = 2):
    """The decode kernel compiled for sm_90: (ttgir, sass)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.kernels.decode_attention import _decode_partial_kernel as kernel

    names = kernel.arg_names
    data = "*u8" if fmt == 2 else "*bf16"
    ptrs = {"q_ptr": "*bf16", "k_ptr": data, "ks_ptr": data, "v_ptr": data, "vs_ptr": data, "bt_ptr": "*i64",
            "lens_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
    consts = dict(SHAPE, BLOCK_N=block_n, FMT=fmt, CD=tl.float16 if fmt == 2 else tl.bfloat16, IEEE=False, USE_DOT=True,
                  FP4_DECODE=fp4_decode, SC_WORDS=fmt == 2)
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n in ("qk_scale", "out_scale") else "i32")
           for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if sig[n] not in ("constexpr", "fp32") and n != "n_splits"}  # the launch specialises these so
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=aligned)
    options = {"num_warps": 4, **({"num_stages": num_stages} if num_stages else {})}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ttgir"], _sass(compiled)


def compile_gluon(block_n: int):
    """The Gluon FP4 kernel (model/kernels/decode_attention_gluon.py) compiled for sm_90 under the launch's register cap
    (decode_attention.GLUON_MAXNREG): (ttgir, sass, registers per thread, stack bytes per thread: spills)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from model.kernels.decode_attention import GLUON_MAXNREG
    from model.kernels.decode_attention_gluon import fp4_decode_partial_kernel as kernel

    names = kernel.arg_names
    ptrs = {"q_ptr": "*bf16", "bt_ptr": "*i64", "lens_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
    consts = {"H": SHAPE["H"], "G": SHAPE["G"], "D": SHAPE["D"], "PAGE": SHAPE["PAGE"], "BLOCK_N": block_n,
              "PREFETCH": False}
    sig = {n: ptrs.get(n) or ("*u8" if n.endswith("_ptr") else "constexpr" if n in consts else
                              "fp32" if n in ("qk_scale", "out_scale") else "i32") for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if sig[n] not in ("constexpr", "fp32") and n not in ("n_splits", "s_ksh", "s_vsh")}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                         attrs=aligned)
    options = {"num_warps": 4, **({"maxnreg": GLUON_MAXNREG} if GLUON_MAXNREG else {})}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    usage = _sass(compiled, "-res-usage")  # "REG:128 STACK:0 SHARED:1024 ..."
    regs, stack = (int(re.search(rf"{f}:(\d+)", usage).group(1)) for f in ("REG", "STACK"))
    return compiled.asm["ttgir"], _sass(compiled), regs, stack


def _sass(compiled, what: str = "-sass") -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), what, f.name], capture_output=True, text=True, check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the engine's short-context launch only (the default set)")
    ap.add_argument("--block-n", default="64", help="comma list of KV rows per tile")
    ap.add_argument("--fp4-decodes", default="2", help="comma list of FP4 tile decodes (decode_attention FP4_DECODE)")
    ap.add_argument("--dump", type=Path, help="write each variant's TTGIR and SASS here")
    ap.add_argument("--gluon", action="store_true", help="also the Gluon FP4 kernel (decode_attention_gluon.py)")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    variants = [("bf16", 0, int(bn), None, 2) for bn in args.block_n.split(",")] + [
        ("fp4", 2, int(bn), 2, int(d)) for bn in args.block_n.split(",") for d in args.fp4_decodes.split(",")]
    result: dict[str, int] = {}
    print(f"{'variant':<22}" + "".join(f"{f:>8}" for f in (*FAMILIES, "all", "tiles")))
    if args.gluon:
        variants += [("fp4_gluon", 2, int(bn), None, None) for bn in args.block_n.split(",")]
    for name, fmt, bn, stages, dec in variants:
        if name == "fp4_gluon":
            ttgir, sass, regs, stack = compile_gluon(bn)
            result.update({f"fp4_gluon_n{bn}_registers": regs, f"fp4_gluon_n{bn}_stack_bytes": stack})
            print(f"fp4_gluon n{bn}: {regs} registers a thread, {stack} bytes of stack (spills)")
        else:
            ttgir, sass = compile_variant(fmt, bn, stages, dec)
        counts, tiles = sass_counts(sass), smem_tiles(ttgir, bn)
        tag = f"{name} n{bn}" + (f" decode{dec}" if dec is not None and fmt == 2 else "")
        print(f"{tag:<22}" + "".join(f"{counts[f]:>8}" for f in (*FAMILIES, "all")) + f"{tiles:>8}")
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            stem = tag.replace(" ", "_")
            (args.dump / f"{stem}.ttgir").write_text(ttgir)
            (args.dump / f"{stem}.sass").write_text(sass)
        key = name if len(variants) == 2 or len(variants) == 3 and args.gluon else tag.replace(" ", "_")
        result.update({f"{key}_sts": counts["STS"], f"{key}_lds": counts["LDS"], f"{key}_ldsm": counts["LDSM"],
                       f"{key}_ldgsts": counts["LDGSTS"], f"{key}_smem_tiles": tiles, f"{key}_instructions": counts["all"]})
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
