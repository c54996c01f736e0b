"""Paged decode attention (Triton) vs the PyTorch reference, dense / fp8 / fp4 caches.

Tolerances: float32 q runs every dot in float32, so the kernel matches the reference to summation
order: atol 2e-3 (observed ~1e-6). bf16 q rounds q and the softmax probabilities to half precision
(K and V are dequantised exactly) and the output is bf16: atol 1e-2 + rtol 2^-7 (about two bf16
steps; observed: one step, 0.0156 at magnitude 2-4). Blocks no sequence owns are
filled with NaN, so a kernel that reads past a sequence's length (or a stale table entry) fails.
"""

import pytest
import torch

from model import fp4, fp8

kern = pytest.importorskip("model.kernels.decode_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-3, rtol=0.0), torch.bfloat16: dict(atol=1e-2, rtol=2**-7)}


def _paged_case(lens, *, H, KVH, D, block_size, seed=0):
    """Random K/V scattered over a shuffled block pool; unowned blocks (and table tails) are NaN."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(1, max(per_seq))
    num_blocks = sum(per_seq) + 3  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=g)
    k = torch.full((num_blocks * block_size + 1, KVH, D), float("nan"))  # + the engine's scratch slot
    v = torch.full_like(k, float("nan"))
    table = torch.full((B, max_blocks), int(order[-1]), dtype=torch.int32)  # tails -> a NaN block
    used = 0
    for b, n in enumerate(lens):
        blocks = order[used:used + per_seq[b]]
        used += per_seq[b]
        table[b, : per_seq[b]] = blocks.int()
        j = torch.arange(n)
        slots = blocks[j // block_size] * block_size + j % block_size
        k[slots] = torch.randn(n, KVH, D, generator=g) * 2
        v[slots] = torch.randn(n, KVH, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def _store(x, kv_format, dtype):
    if kv_format == "dense":
        return x.to(dtype)
    if kv_format == "fp8":
        return fp8.quantize(x)
    return fp4.quantize(x)


def _to(x, device):
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


CASES = [  # (kv_format, q dtype, lens, H, KVH, D, block_size, block_n, num_splits)
    ("dense", torch.float32, [37, 0, 100, 5], 8, 2, 64, 16, 16, 3),
    ("dense", torch.bfloat16, [37, 0, 100, 5], 8, 2, 64, 16, 16, None),
    ("fp8", torch.float32, [37, 100, 0, 16], 8, 2, 64, 8, 16, 3),
    ("fp8", torch.bfloat16, [37, 100, 0, 16], 8, 2, 64, 8, 16, 3),
    ("fp4", torch.float32, [37, 0, 100, 5], 8, 2, 64, 16, 16, 3),
    ("fp4", torch.bfloat16, [37, 0, 100, 5], 8, 2, 64, 16, 16, 3),
    ("fp4", torch.bfloat16, [50, 19], 6, 3, 128, 1, 32, 2),  # slot list (block_size 1), G = 2 padded
    ("fp4", torch.float32, [23, 40], 4, 1, 16, 4, 16, 2),  # the debug model's head_dim: no tl.dot
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-D{c[5]}-bs{c[6]}" for c in CASES])
def test_matches_reference(case):
    kv_format, qdt, lens, H, KVH, D, bs, bn, splits = case
    q, k, v, table, lens_t = _paged_case(lens, H=H, KVH=KVH, D=D, block_size=bs)
    q = q.to(qdt)
    cache_dt = torch.bfloat16 if qdt == torch.bfloat16 else torch.float32
    kc, vc = _store(k, kv_format, cache_dt), _store(v, kv_format, cache_dt)
    ref = kern.decode_attention_ref(q, kc, vc, table, lens_t, bs, kv_format=kv_format)
    out = kern.decode_attention(q.to(DEVICE), _to(kc, DEVICE), _to(vc, DEVICE), table.to(DEVICE), lens_t.to(DEVICE),
                                bs, kv_format=kv_format, block_n=bn, num_splits=splits).cpu()
    assert out.dtype == qdt and out.shape == q.shape
    assert torch.isfinite(out).all()  # no NaN block was read
    assert torch.allclose(out.float(), ref.float(), **TOL[qdt])
    empty = [b for b, n in enumerate(lens) if n == 0]
    assert (out[empty] == 0).all()


def test_reference_is_plain_attention_and_fp4_error_is_small():
    """The reference itself: against torch's SDPA on the dequantised context, and fp4 vs dense."""
    q, k, v, table, lens = _paged_case([33], H=4, KVH=2, D=32, block_size=8, seed=3)
    slots = (table[0, torch.arange(33) // 8].long() * 8 + torch.arange(33) % 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k[slots].transpose(0, 1)[None], v[slots].transpose(0, 1)[None], enable_gqa=True)[:, :, 0]
    dense = kern.decode_attention_ref(q, k, v, table, lens, 8)
    assert torch.allclose(dense, sdpa, atol=1e-5)
    q4 = kern.decode_attention_ref(q, fp4.quantize(k), fp4.quantize(v), table, lens, 8, kv_format="fp4")
    err = (q4 - dense).abs().max().item()
    assert 1e-3 < err < 0.5  # quantised (not silently dense), but still the same attention


def test_splits_agree_and_bad_shapes_are_refused():
    q, k, v, table, lens = _paged_case([70, 3], H=4, KVH=2, D=32, block_size=16, seed=5)
    kc, vc = _to(fp4.quantize(k), DEVICE), _to(fp4.quantize(v), DEVICE)
    args = (q.to(DEVICE), kc, vc, table.to(DEVICE), lens.to(DEVICE), 16)
    one = kern.decode_attention(*args, kv_format="fp4", num_splits=1, block_n=16)
    many = kern.decode_attention(*args, kv_format="fp4", num_splits=5, block_n=16)
    assert torch.allclose(one, many, atol=1e-5)
    with pytest.raises(ValueError, match="group evenly"):
        kern.decode_attention(q[:, :3].to(DEVICE), kc, vc, table.to(DEVICE), lens.to(DEVICE), 16, kv_format="fp4")
    with pytest.raises(TypeError, match="pair"):
        kern.decode_attention(*args[:1], k.to(DEVICE), v.to(DEVICE), *args[3:], kv_format="fp4")


@pytest.mark.skipif(DEVICE != "cuda", reason="decode 2 / 3 (inline PTX) run compiled on CUDA only")
@pytest.mark.parametrize("decode,words", [(2, False), (3, False), (3, True)])  # (2, True): the default
def test_fp4_decode_variants_match_reference(decode, words, monkeypatch):
    monkeypatch.setattr(kern, "FP4_SC_WORDS", words)
    for qdt, lens, H, KVH, D, bs, bn in [(torch.bfloat16, [37, 0, 300, 5], 8, 2, 64, 16, 64),
                                         (torch.float32, [200, 77], 8, 2, 128, 16, 128)]:
        q, k, v, table, lens_t = _paged_case(lens, H=H, KVH=KVH, D=D, block_size=bs, seed=decode)
        q = q.to(qdt)
        kc, vc = fp4.quantize(k), fp4.quantize(v)
        ref = kern.decode_attention_ref(q, kc, vc, table, lens_t, bs, kv_format="fp4")
        out = kern.decode_attention(q.to(DEVICE), _to(kc, DEVICE), _to(vc, DEVICE), table.to(DEVICE),
                                    lens_t.to(DEVICE), bs, kv_format="fp4", block_n=bn, fp4_decode=decode,
                                    fp4_kernel="triton").cpu()
        assert torch.isfinite(out).all()
        assert torch.allclose(out.float(), ref.float(), **TOL[qdt])


@pytest.mark.parametrize("kernel", ["triton", pytest.param("gluon", marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="the Gluon kernel runs compiled on CUDA only"))])
@pytest.mark.parametrize("wave", [False, True], ids=["few-programs", "a-wave"])
def test_fp4_short_context_default_launch_matches_reference(wave, kernel):
    """The fp4 launch chosen for block tables of <= FP4_SHORT_CONTEXT tokens (a rollout's decode): 32-token tiles
    when the (sequence, KV head) programs are fewer than the SMs, 64-token tiles in two splits when they fill one
    to four waves (the Triton kernel in two pipeline stages; the Gluon one under its register cap). Lengths spread
    over the table, one sequence empty."""
    sms, KVH = kern._num_sms(torch.device(DEVICE)), 2 if wave else 1
    B = -(-sms // KVH) if wave else 1
    lens = [int(x) for x in torch.linspace(0, 70, B).round()] if B > 1 else [57]
    q, k, v, table, lens_t = _paged_case(lens, H=4, KVH=KVH, D=64, block_size=16, seed=7)
    assert table.shape[1] * 16 <= kern.FP4_SHORT_CONTEXT
    q = q.to(torch.bfloat16)
    kc, vc = fp4.quantize(k), fp4.quantize(v)
    ref = kern.decode_attention_ref(q, kc, vc, table, lens_t, 16, kv_format="fp4")
    out = kern.decode_attention(q.to(DEVICE), _to(kc, DEVICE), _to(vc, DEVICE), table.to(DEVICE), lens_t.to(DEVICE),
                                16, kv_format="fp4", fp4_kernel=kernel).cpu()
    assert torch.isfinite(out).all() and torch.allclose(out.float(), ref.float(), **TOL[torch.bfloat16])


GLUON_CASES = [  # (q dtype, lens, H, KVH, D, block_size, block_n, num_splits)
    (torch.bfloat16, [37, 0, 300, 5], 8, 2, 128, 16, 64, None),
    (torch.bfloat16, [37, 0, 300, 5], 16, 8, 128, 16, 32, 3),  # the Qwen3-0.6B heads, splits
    (torch.float16, [200, 77, 1], 4, 1, 64, 16, 64, None),  # head_dim 64, G = 4
    (torch.bfloat16, [50, 19], 6, 3, 128, 1, 64, 2),  # slot list (block_size 1)
    (torch.bfloat16, [129, 64, 63], 32, 2, 64, 16, None, None),  # G = 16, the default launch
]


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel runs compiled on CUDA only")
@pytest.mark.parametrize("prefetch", [False, True], ids=["loads-in-turn", "prefetch"])
@pytest.mark.parametrize("case", GLUON_CASES, ids=[str(i) for i in range(len(GLUON_CASES))])
def test_gluon_fp4_kernel_matches_reference(case, prefetch, monkeypatch):
    """model/kernels/decode_attention_gluon.py (K decoded in the mma operand layout, channels permuted) against the
    reference; NaN in every block no sequence owns, so a wrong row or a read past a length shows."""
    monkeypatch.setattr(kern, "GLUON_PREFETCH", prefetch)
    qdt, lens, H, KVH, D, bs, bn, splits = case
    q, k, v, table, lens_t = _paged_case(lens, H=H, KVH=KVH, D=D, block_size=bs, seed=len(lens) + D)
    q = q.to(qdt)
    kc, vc = fp4.quantize(k), fp4.quantize(v)
    ref = kern.decode_attention_ref(q, kc, vc, table, lens_t, bs, kv_format="fp4")
    out = kern.decode_attention(q.to(DEVICE), _to(kc, DEVICE), _to(vc, DEVICE), table.to(DEVICE), lens_t.to(DEVICE),
                                bs, kv_format="fp4", block_n=bn, num_splits=splits, fp4_kernel="gluon").cpu()
    assert torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref.float(), **TOL[torch.bfloat16])
    assert (out[lens_t == 0] == 0).all()


def test_gluon_fp4_kernel_refuses_what_it_cannot_run():
    """Asked for explicitly, the Gluon kernel names why a call is not its own (one line); never on another path."""
    q, k, v, table, lens_t = _paged_case([20, 9], H=4, KVH=2, D=64, block_size=16)
    kc, vc = _to(fp4.quantize(k), DEVICE), _to(fp4.quantize(v), DEVICE)
    args = (table.to(DEVICE), lens_t.to(DEVICE), 16)
    with pytest.raises(ValueError, match="float32 q keeps" if DEVICE == "cuda" else "CUDA only"):
        kern.decode_attention(q.to(DEVICE), kc, vc, *args, kv_format="fp4", fp4_kernel="gluon")
    with pytest.raises(ValueError, match="'triton' or 'gluon'"):
        kern.decode_attention(q.to(DEVICE), kc, vc, *args, kv_format="fp4", fp4_kernel="cuda")
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="block_n 128"):
            kern.decode_attention(q.to(DEVICE, torch.bfloat16), kc, vc, *args, kv_format="fp4", fp4_kernel="gluon",
                                  block_n=128)
