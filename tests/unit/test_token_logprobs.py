"""Target log-probs and entropy from hidden states and the head (seed §5.2.2): chunked torch path and Triton
row kernels vs the materialising reference.

Tolerances (tests/numerics.py, the suite's rule). fp32: the chunked paths compute the same formulas in fp32 as
the reference does and differ from it only in the order of their sums (the online log-sum-exp over vocabulary
tiles, the entropy's Σ p·s in one sweep, W's gradient summed chunk by chunk), so each is held to the forward-error
bound of that chain against the float64 reference: the logit matmul (d terms), three V-term reductions (max, Σ exp,
Σ p·s; the V-term matmul into grad_h), the n-term sum into grad_W and a dozen elementwise roundings (exp, log, the
gradient formula; on a GPU the fast exp/log cost a few ulp, inside one γ each). That is ≈ 2e-4 of the tensor's
largest value at these shapes; the implementations land ~1e-2 of it. bf16 inputs: the logits are rounded to bf16
exactly where the reference rounds them (h @ Wᵀ in bf16), the logit gradient is stored in bf16 before its two
matmuls, so values and gradients are compared in relative norm, within 3% of the float64 result on the same
(upcast) inputs: the materialising reference itself, with the same roundings, lands at 0.5-1.2% over seeds.
"""

import math

import pytest
import torch

from model.token_logprobs import default_chunk_size, token_logprobs, token_logprobs_reference
from tests.largest_output import LargestOutput
from tests.numerics import assert_close_to_reference, float64_reference

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["triton", "torch"]
N, D, V, CHUNK, BLOCK_V = 37, 16, 1000, 16, 256  # 37 = 2·16 + 5 tokens; 1000 = 3·256 + 232 vocabulary ids


def _inputs(n=N, d=D, v=V, dtype=torch.float32, seed=0, scale=1.0):
    """Leaf h [n, d], w [v, d], targets [n], and the loss weights a, b [n] (random signs)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g) * scale
    w = torch.randn(v, d, generator=g) * 0.5
    y = torch.randint(0, v, (n,), generator=g)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    leaf = lambda x: x.to(DEVICE, dtype).requires_grad_()  # noqa: E731
    return leaf(h), leaf(w), y.to(DEVICE), a.to(DEVICE), b.to(DEVICE)


def _run(impl, h, w, y, a, b, temperature=1.0, entropy=True, use_lp=True, use_ent=True, **kw):
    """(logprobs, entropy, h.grad, w.grad) after backward of L = Σ a·lp + Σ b·H (the terms asked for)."""
    h.grad = w.grad = None
    lp, ent = token_logprobs(h, w, y, temperature, entropy=entropy, impl=impl, **kw)
    loss = (a * lp).sum() if use_lp else 0.0
    if use_ent:
        loss = loss + (b * ent).sum()
    if h.requires_grad or w.requires_grad:
        loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad


def _float64(h, w, y, a, b, temperature=1.0, **kw):
    """The reference in float64 on the same (exactly upcast) inputs: the exact values for these tests."""
    x = [t.detach().double().requires_grad_(t.requires_grad) for t in (h, w)]
    with float64_reference():  # the reference's .float() keeps float64
        return _run("reference", *x, y, a.double(), b.double(), temperature, **kw)


def _fp32_stages(n=N, d=D, v=V):
    return [(d, 1), (v, 3), (n, 1), (2, 12)]


def _assert_fp32(out, ref, n=N, d=D, v=V):
    for name, o, r in zip(("logprobs", "entropy", "grad h", "grad w"), out, ref):
        assert (o is None) == (r is None), name
        if o is not None:
            assert o.dtype == torch.float32, name
            assert_close_to_reference(o.cpu(), r.cpu(), dtype=torch.float32, reduction=_fp32_stages(n, d, v), msg=name)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_values_and_gradients_match_reference(impl, temperature):
    """37 tokens in chunks of 16 (the last one partial), V = 1000 in tiles of 256 (the last one partial)."""
    x = _inputs()
    out = _run(impl, *x, temperature, chunk_size=CHUNK, block_v=BLOCK_V)
    ref = _float64(*x, temperature)
    _assert_fp32(out, ref)
    assert ref[1].min() > 1.0 and ref[3].abs().max() > 1e-1  # a non-trivial case: spread rows, real gradients
    # the fp32 reference agrees too (it is the same contract)
    ref32 = _run("reference", *x, temperature)
    _assert_fp32(ref32, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_within_stated_tolerance(impl):
    x = _inputs(dtype=torch.bfloat16)
    out = _run(impl, *x, 0.7, chunk_size=CHUNK, block_v=BLOCK_V)
    ref = _float64(*x, 0.7)
    assert out[0].dtype == out[1].dtype == torch.float32
    assert out[2].dtype == out[3].dtype == torch.bfloat16
    for name, o, r in zip(("logprobs", "entropy", "grad h", "grad w"), out, ref):
        assert _rel(o, r) < 3e-2, name


@pytest.mark.parametrize("impl", IMPLS)
def test_entropy_off_and_unused(impl):
    """entropy=False returns None and the log-prob gradient alone; entropy=True with only lp in the loss gives the
    same gradient (the entropy's incoming gradient is None: the kernel skips its term)."""
    x = _inputs()
    off = _run(impl, *x, 0.7, entropy=False, use_ent=False, chunk_size=CHUNK, block_v=BLOCK_V)
    assert off[1] is None
    _assert_fp32(off, _float64(*x, 0.7, entropy=False, use_ent=False))
    unused = _run(impl, *x, 0.7, use_ent=False, chunk_size=CHUNK, block_v=BLOCK_V)
    for o, u in zip((off[0], off[2], off[3]), (unused[0], unused[2], unused[3])):
        assert torch.equal(o, u)


@pytest.mark.parametrize("impl", IMPLS)
def test_entropy_gradient_alone(impl):
    """L = Σ b·H with the log-probs unused: their incoming gradient is None."""
    x = _inputs()
    out = _run(impl, *x, 0.7, use_lp=False, chunk_size=CHUNK, block_v=BLOCK_V)
    _assert_fp32(out, _float64(*x, 0.7, use_lp=False))


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_of_one_input_only(impl):
    """Only h requires grad (a frozen head), only w does, and neither (inference)."""
    h, w, y, a, b = _inputs()
    w.requires_grad_(False)
    out = _run(impl, h, w, y, a, b, chunk_size=CHUNK, block_v=BLOCK_V)
    assert out[3] is None
    _assert_fp32(out, _float64(h, w, y, a, b))
    h.requires_grad_(False)
    w.requires_grad_(True)
    out = _run(impl, h, w, y, a, b, chunk_size=CHUNK, block_v=BLOCK_V)
    assert out[2] is None
    _assert_fp32(out, _float64(h, w, y, a, b))
    w.requires_grad_(False)
    lp, ent = token_logprobs(h, w, y, entropy=True, impl=impl, chunk_size=CHUNK, block_v=BLOCK_V)
    assert not lp.requires_grad and not ent.requires_grad


@pytest.mark.parametrize("impl", IMPLS)
def test_uniform_distribution_closed_form(impl):
    """h = 0: every logit is 0, p uniform, so lp = -log V, H = log V, ∂H/∂z = 0 and ∂lp/∂z_v = (δ_{v,y} - 1/V)/τ,
    whence ∂L/∂W_v = Σ_i a_i (δ_{v,y_i} - 1/V) h_i / τ = 0 and ∂L/∂h_i = a_i (W_{y_i} - mean_v W_v) / τ."""
    h, w, y, a, b = _inputs(n=5)
    h = torch.zeros_like(h).requires_grad_()
    lp, ent, gh, gw = _run(impl, h, w, y, a, b, 0.7, chunk_size=2, block_v=BLOCK_V)
    log_v = math.log(V)
    w64 = w.detach().double().cpu()
    gh_ref = a.double().cpu()[:, None] * (w64[y.cpu()] - w64.mean(0)) / 0.7
    bound = dict(dtype=torch.float32, reduction=[(V, 2), (2, 6)])
    assert_close_to_reference(lp.cpu(), torch.full((5,), -log_v, dtype=torch.float64), scale=log_v, msg="lp", **bound)
    assert_close_to_reference(ent.cpu(), torch.full((5,), log_v, dtype=torch.float64), scale=log_v, msg="H", **bound)
    assert_close_to_reference(gh.cpu(), gh_ref, msg="grad h", **bound)
    assert torch.equal(gw, torch.zeros_like(gw))  # products with h = 0: exact zeros


@pytest.mark.parametrize("impl", IMPLS)
def test_peaked_logits_stay_finite_and_accurate(impl):
    """Logits of magnitude ~100s: near one-hot rows, H ≈ 0. The online log-sum-exp must not overflow and the
    entropy, kept relative to the running max, must not cancel."""
    x = _inputs(n=8, scale=30.0)
    out = _run(impl, *x, chunk_size=5, block_v=BLOCK_V)
    ref = _float64(*x)
    assert all(torch.isfinite(t).all() for t in out)
    assert ref[1].min() < 1e-3  # some rows nearly one-hot
    _assert_fp32((out[0], None, out[2], out[3]), (ref[0], None, ref[2], ref[3]), n=8)
    # the entropy per row on the scale of that row's logits, not of the largest H: H = lse - Σ p·s (and log p =
    # s - lse in the reference) are differences of numbers of that size, so a near-one-hot row's H ≈ 1e-9 is
    # known to ~u·max|s| absolute, no better, in fp32
    h, w = x[0].detach().double().cpu(), x[1].detach().double().cpu()
    assert_close_to_reference(out[1].cpu(), ref[1].cpu(), dtype=torch.float32, reduction=_fp32_stages(n=8),
                              scale=(h @ w.t()).abs().amax(-1), msg="entropy per row")


def test_chunk_size_and_tile_do_not_change_the_result_much():
    """Chunks of 1, 7 and 64 (>= n) tokens and tiles of 128 / 1024 (one tile) against the float64 reference."""
    x = _inputs(n=9)
    ref = _float64(*x, 0.7)
    for chunk, bv in ((1, 128), (7, 1024), (64, None)):
        for impl in IMPLS:
            _assert_fp32(_run(impl, *x, 0.7, chunk_size=chunk, block_v=bv), ref, n=9)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens(impl):
    h, w, y, a, b = _inputs(n=0)
    lp, ent, gh, gw = _run(impl, h, w, y, a, b, chunk_size=CHUNK)
    assert lp.shape == ent.shape == (0,) and gh.shape == (0, D)
    assert torch.equal(gw, torch.zeros_like(gw))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_by_vocab_tensor(impl):
    """64 tokens in chunks of 8: autograd saves nothing of chunk × V elements or more but the head, and no op,
    forward or backward, creates a tensor larger than a chunk's fp32 logits or the head's fp32 gradient."""
    n, d, v, chunk = 64, 8, 300, 8
    h, w, y, a, b = _inputs(n=n, d=d, v=v)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with LargestOutput() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = token_logprobs(h, w, y, entropy=True, impl=impl, chunk_size=chunk, block_v=128)
    assert saved and all(t is w or t.numel() < chunk * v for t in saved), [tuple(t.shape) for t in saved]
    with LargestOutput() as back:
        ((a * lp).sum() + (b * ent).sum()).backward()
    assert max(mode.largest, back.largest) <= 4 * max(chunk * v, v * d) < 4 * n * v
    with LargestOutput() as mode:  # the probe does see materialised logits
        _run("reference", h, w, y, a, b)
    assert mode.largest >= 4 * n * v


def test_dispatch_chunk_size_and_argument_checks():
    x = _inputs(n=6)
    auto = _run("auto", *x)
    explicit = _run("triton" if DEVICE == "cuda" else "torch", *x)
    for p, q in zip(auto, explicit):
        assert torch.equal(p, q)
    h, w, y = x[:3]
    with pytest.raises(ValueError, match="impl"):
        token_logprobs(h, w, y, impl="cuda")
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(h, w, y[:-1])
    with pytest.raises(ValueError, match="w \\[V, d\\]"):
        token_logprobs(h, w[:, :-1], y)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h, w, y, 0.0)
    with pytest.raises(ValueError, match="share a dtype"):
        token_logprobs(h, w.double(), y)
    assert default_chunk_size(151936, torch.bfloat16) == 1728
    assert default_chunk_size(151936, torch.float32) == 832
    assert default_chunk_size(10**7, torch.float32) == 64
    assert token_logprobs_reference(h, w, y)[1] is None
