"""bench/kernel_isa.py: the SASS and TTGIR readers, and a compile of the decode-attention kernel for sm_90 on this
CPU (Triton's wheel carries ptxas and cuobjdump)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kernel_isa", ROOT / "bench" / "kernel_isa.py")
isa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isa)

SASS = """
        /*0100*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R8.64], P0 ;
        /*0110*/              @!P1 LDGSTS.E.64 [R5], desc[UR4][R10.64] ;
        /*0120*/                   LDGDEPBAR ;
        /*0130*/                   STS.128 [R2], R12 ;
        /*0140*/                   STSM.16.M88.4 [R4], R16 ;
        /*0150*/               @P0 LDSM.16.MT88.4 R20, [R6] ;
        /*0160*/                   LDS.64 R22, [R7] ;
        /*0170*/                   HMMA.16816.F32 R24, R20, R22, R24 ;
        /*0180*/                   LOP3.LUT R1, R2, 0xf0f0f0f0, RZ, 0xc0, !PT ;
        /*0190*/              @!PT LDS RZ, [RZ] ;
"""


def test_sass_counts_take_each_opcode_to_its_family():
    c = isa.sass_counts(SASS)
    assert (c["LDGSTS"], c["STS"], c["LDSM"], c["LDS"], c["HMMA"], c["LOP3"], c["LDG"]) == (2, 2, 1, 2, 1, 1, 0)
    assert c["all"] == 10  # LDGDEPBAR counted in all, under no family


def test_smem_tiles_count_register_tiles_of_at_least_block_n_rows():
    ttgir = """
    %q = ttg.local_alloc %a : (tensor<16x64xf16, #blocked>) -> !ttg.memdesc<16x64xf16, #shared, #smem>
    %w = ttg.local_alloc : () -> !ttg.memdesc<1x64x64xi8, #shared1, #smem, mutable>
    %k = ttg.local_alloc %b : (tensor<64x64xf16, #blocked1>) -> !ttg.memdesc<64x64xf16, #shared, #smem>
    %v = ttg.local_alloc %c : (tensor<128x64xf16, #blocked1>) -> !ttg.memdesc<128x64xf16, #shared, #smem>
    %kt = ttg.convert_layout %d : tensor<128x64xf16, #linear> -> tensor<128x64xf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>>
    %vt = ttg.convert_layout %e : tensor<64x128xf16, #blocked5> -> tensor<64x128xf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>>
    %pa = ttg.convert_layout %f : tensor<16x64xf16, #mma> -> tensor<16x64xf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>>
    """
    assert isa.smem_tiles(ttgir, 64) == 3 and isa.smem_tiles(ttgir, 128) == 1  # %k, %v, %vt; then %v


def test_the_decode_kernel_compiles_for_sm90_here_and_bf16_tiles_arrive_by_async_copy():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests interpret kernels; this compiles
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_isa.py"), "--quick", "--gluon"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].removeprefix("RESULT ").split())
    r = {k: int(v) for k, v in r.items()}
    assert r["bf16_ldgsts"] > 0 and r["bf16_smem_tiles"] == 0  # K and V tiles reach shared memory by async copy
    assert r["fp4_ldgsts"] > 0 and r["fp4_instructions"] > 0  # FP4's bytes too (its decoded tiles: BENCHMARKS.md)
    assert r["fp4_smem_tiles"] == 4  # Triton: the decoded K and V halves each through shared memory
    assert r["fp4_gluon_smem_tiles"] == 1  # Gluon: V only; K decoded in the mma operand layout
    assert r["fp4_gluon_sts"] < r["fp4_sts"]
    # under the launch's register cap (4 programs an SM) the 64-token tile spills nothing
    assert 0 < r["fp4_gluon_n64_registers"] <= 128 and r["fp4_gluon_n64_stack_bytes"] == 0
