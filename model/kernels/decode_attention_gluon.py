"""FP4 paged decode attention as a Gluon kernel: the decoded K tile lands in the tensor-core operand registers.

Seed §2.4.4 stores the main KV cache in FP4 and dequantises it before attention. In the Triton kernel
(model/kernels/decode_attention.py, `_decode_partial_kernel`, FMT 2) every decoded K and V tile is written to shared
memory and read back to reach the mma operand layout (32 KB a 64-token tile: BENCHMARKS.md, "Where FP4 decode
attention loses to bf16"); Triton cannot decode in that layout itself, because the per-block scale's load fixes the
tile's layout (its RemoveLayoutConversions pass moves the operand conversion after the decode). Gluon states the
layouts, so the decode can be written in the operand layout:

- S = q · Kᵀ runs as `mma_v2` (m16n8k16) with Kᵀ [D, BLOCK_N] as the B operand in its dot-operand layout
  (k_width 2): lane l holds, for token n = l // 4 (+ 8 per warp), the channel pairs k = 16c + 8j + 2t + {0, 1}
  (t = l % 4, c < D / 16, j < 2). A byte holds two channels, so each pair is one byte, and the channel order of the
  product is free (q is permuted the same way): pair (c, j) of lane t reads byte TB·t + 2c + j (TB = D / 8), so a
  lane's bytes of one token are TB contiguous bytes (one 128-bit load at D = 128) and its two scale bytes are
  adjacent. Loaded in that `BlockedLayout`, decoded elementwise (`E2M1X8_F16_PTX`, the Triton kernel's PTX: E2M1
  · 2^-14 · scale in fp16, exact), joined (low, high nibble) and relabelled by reshape/permute, the tile is already
  in the dot-operand layout: the conversion is asserted trivial (no data movement), no shared memory.
- P · V reduces over tokens, which the bytes do not pair (a byte is two channels of one token): V is decoded in the
  same loads and converted to its operand layout through shared memory, as in the Triton kernel (half the trip).

Same contract as `_decode_partial_kernel` (normalised partial outputs and log2-sum-exp per split, merged by
`_merge_splits_kernel`); bf16 / fp16 q (float32 q keeps the Triton kernel's exact float32 products); head_dim 64 or
128; G = H / KVH <= 16 query heads per KV head; BLOCK_N 32 or 64. CUDA only (Gluon has no interpreter): the parity
test runs on a GPU (tests/unit/test_decode_attention.py); the Triton kernel keeps the CPU-interpreted tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from model.kernels.fp4 import E2M1X8_F16_PTX

_ASM: gl.constexpr = gl.constexpr(E2M1X8_F16_PTX)


@gluon.jit
def _fp4_load(ptr, sc_ptr, row, valid, sc_row, sc_valid, DB: gl.constexpr, BL: gl.constexpr, P3: gl.constexpr):
    """One tile's FP4 rows as loaded: bytes [BLOCK_N, DB] in BL (a lane's TB bytes of a row contiguous) and the
    rows' scale bytes [BLOCK_N, DB / 8] (a lane's two adjacent ones)."""
    b = gl.arange(0, DB, layout=gl.SliceLayout(0, BL))
    p = gl.load(ptr + row[:, None] + b[None, :], mask=valid[:, None], other=0)
    jb = gl.arange(0, DB // 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, P3)))
    return p, gl.load(sc_ptr + sc_row[:, None] + jb[None, :], mask=sc_valid[:, None], other=0)


@gluon.jit
def _fp4_decode(p, sb, BLOCK_N: gl.constexpr, DB: gl.constexpr, BL: gl.constexpr, P3: gl.constexpr):
    """Loaded bytes and scales -> (low nibbles, high nibbles), each [BLOCK_N, DB] fp16 in BL: E2M1 · 2^-14 · the
    row's E4M3 scale of that byte's 8-byte block (exact); the scales broadcast in registers."""
    NB: gl.constexpr = DB // 8
    sc = gl.expand_dims(sb.to(gl.float8e4nv, bitcast=True).to(gl.float16), 2)
    sc = gl.broadcast(sc, gl.zeros([BLOCK_N, NB, 8], gl.float16, layout=P3))[0]
    sc = gl.convert_layout(gl.reshape(sc, [BLOCK_N, DB]), BL, assert_trivial=True)
    return gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r,r", [p, sc], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=4)


@gluon.jit
def _tile_loads(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, n0, end, kvh, s_kt, s_kh, s_kst, s_ksh, s_vt, s_vh, s_vst, s_vsh,
                PAGE: gl.constexpr, BLOCK_N: gl.constexpr, DB: gl.constexpr, BL: gl.constexpr, P3: gl.constexpr):
    """The K and V bytes and scales of the tile at n0 (rows at or past `end` masked: nothing read)."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BL))
    valid = n < end
    slot = gl.load(bt_row + n // PAGE, mask=valid, other=0).to(gl.int64) * PAGE + n % PAGE
    n_sc = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, P3)))
    sc_valid = n_sc < end
    slot_sc = gl.load(bt_row + n_sc // PAGE, mask=sc_valid, other=0).to(gl.int64) * PAGE + n_sc % PAGE
    kp, ksb = _fp4_load(k_ptr, ks_ptr, slot * s_kt + kvh * s_kh, valid, slot_sc * s_kst + kvh * s_ksh, sc_valid,
                        DB, BL, P3)
    vp, vsb = _fp4_load(v_ptr, vs_ptr, slot * s_vt + kvh * s_vh, valid, slot_sc * s_vst + kvh * s_vsh, sc_valid,
                        DB, BL, P3)
    return kp, ksb, vp, vsb


@gluon.jit
def fp4_decode_partial_kernel(
    q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, qk_scale, out_scale,
    s_qb, s_qh, s_kt, s_kh, s_kst, s_ksh, s_vt, s_vh, s_vst, s_vsh, s_bt, chunk, n_splits,
    H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
    PREFETCH: gl.constexpr,
):
    DB: gl.constexpr = D // 2
    TB: gl.constexpr = DB // 4  # bytes of one token row per lane
    BL: gl.constexpr = gl.BlockedLayout([1, TB], [8, 4], [4, 1], [1, 0])
    P3: gl.constexpr = gl.BlockedLayout([1, TB // 8, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    VEC: gl.constexpr = gl.SliceLayout(1, MMA)

    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(lens_ptr + b)
    start = split * chunk
    end = gl.minimum(start + chunk, seq_len)
    bt_row = bt_ptr + b.to(gl.int64) * s_bt

    # q in the products' channel order: k = 16c + 8j + 2t + e <-> stored channel 2 (TB t + 2c + j) + e
    g = gl.arange(0, 16, layout=gl.SliceLayout(1, LA))
    k = gl.arange(0, D, layout=gl.SliceLayout(0, LA))
    ch = 2 * (TB * ((k // 2) % 4) + 2 * (k // 16) + (k // 8) % 2) + k % 2
    q_row = q_ptr + b.to(gl.int64) * s_qb + (kvh * G + g) * s_qh
    q = gl.load(q_row[:, None] + ch[None, :], mask=(g < G)[:, None], other=0.0).to(gl.float16)

    acc = gl.zeros([16, D], gl.float32, layout=MMA)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=VEC)
    l_i = gl.zeros([16], gl.float32, layout=VEC)
    # PREFETCH: each iteration issues the next tile's loads before decoding this one (registers double-buffered)
    if PREFETCH:
        kp, ksb, vp, vsb = _tile_loads(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, start, end, kvh, s_kt, s_kh, s_kst, s_ksh,
                                       s_vt, s_vh, s_vst, s_vsh, PAGE, BLOCK_N, DB, BL, P3)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            nkp, nksb, nvp, nvsb = _tile_loads(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, n0 + BLOCK_N, end, kvh, s_kt,
                                               s_kh, s_kst, s_ksh, s_vt, s_vh, s_vst, s_vsh, PAGE, BLOCK_N, DB, BL, P3)
        else:
            kp, ksb, vp, vsb = _tile_loads(k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, n0, end, kvh, s_kt, s_kh, s_kst,
                                           s_ksh, s_vt, s_vh, s_vst, s_vsh, PAGE, BLOCK_N, DB, BL, P3)
        k_lo, k_hi = _fp4_decode(kp, ksb, BLOCK_N, DB, BL, P3)
        kt = gl.reshape(gl.join(k_lo, k_hi), [BLOCK_N, 4, TB // 2, 2, 2])  # (n, t, c, j, e)
        kt = gl.reshape(gl.permute(kt, [2, 3, 1, 4, 0]), [D, BLOCK_N])      # (c, j, t, e) -> k, then n
        kt = gl.convert_layout(kt, LB, assert_trivial=True)
        s = mma_v2(q, kt, gl.zeros([16, BLOCK_N], gl.float32, layout=MMA))
        s_valid = (n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))) < end
        s = gl.where(s_valid[None, :], s * qk_scale, float("-inf"))  # log2 units
        m_new = gl.maximum(m_i, gl.max(s, axis=1))  # finite: every tile has a valid token
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        v_lo, v_hi = _fp4_decode(vp, vsb, BLOCK_N, DB, BL, P3)
        vt = gl.convert_layout(gl.reshape(gl.join(v_lo, v_hi), [BLOCK_N, D]), LB)  # stored channel order
        acc = mma_v2(gl.convert_layout(p.to(gl.float16), LA), vt, acc * alpha[:, None])
        if PREFETCH:
            kp, ksb, vp, vsb = nkp, nksb, nvp, nvsb
    inv_l = out_scale / gl.where(l_i > 0, l_i, 1.0)  # an empty split writes 0 and lse -inf
    go = gl.arange(0, 16, layout=VEC)
    row = (b * H + kvh * G + go).to(gl.int64) * n_splits + split
    gm = go < G
    gl.store(lse_ptr + row, gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf")), mask=gm)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
    gl.store(o_ptr + row[:, None] * D + d[None, :], acc * inv_l[:, None], mask=gm[:, None])
