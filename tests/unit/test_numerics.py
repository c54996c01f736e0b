"""tests/numerics.py, the suite's rule for floating-point assertions: the bound accepts float32 results summed in any
order (sums in other orders and chunkings, a matmul against an explicit loop, another BLAS, another thread count)
against their float64 reference, and rejects genuine bugs of realistic size (a term left out, a wrong scale, a
1e-3 relative error, bfloat16 arithmetic where float32 was meant), so it is not vacuous."""

import math

import numpy as np
import pytest
import torch

from tests.numerics import (assert_close_to_reference, assert_paths_agree, decoder_rounding, error_bound,
                            float64_reference, gamma, relative_bound, unit_roundoff)

N = 1000


def test_the_bound_is_gamma_n_of_the_dtypes_unit_roundoff():
    u = 2.0**-24
    assert unit_roundoff(torch.float32) == u and unit_roundoff(torch.bfloat16) == 2.0**-8
    assert gamma(N, torch.float32) == pytest.approx(N * u / (1 - N * u), rel=1e-12)
    assert relative_bound(torch.float32, N, 3) == pytest.approx((1 + gamma(N, torch.float32)) ** 3 - 1, rel=1e-9)
    ref = torch.tensor([3.0, -4.0, 0.5], dtype=torch.float64)  # default scale: the largest magnitude, 4
    bound = error_bound(ref, dtype=torch.float32, reduction=N)
    assert bound.shape == ref.shape and torch.allclose(bound, torch.full((3,), 4 * (gamma(N, torch.float32) + gamma(N, torch.float64)),
                                                                           dtype=torch.float64), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="no error bound"):
        gamma(256, torch.bfloat16)  # n·u = 1: nothing can be said
    with pytest.raises(ValueError, match="vacuous"):
        relative_bound(torch.bfloat16, 64, 4)  # (1.25)^4 − 1 > 1: would accept anything


def _terms(signed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, generator=g) if signed else torch.rand(N, generator=g)).float()


def _sums_in_other_orders(x: torch.Tensor) -> dict[str, float]:
    """One float32 sum, evaluated the ways a machine might."""
    a = x.numpy()

    def loop(values) -> float:
        s = np.float32(0)
        for v in values:
            s = np.float32(s + v)
        return float(s)

    out = {"torch.sum": float(x.sum()), "left to right": loop(a), "right to left": loop(a[::-1]),
           "ascending": loop(np.sort(a)), "descending": loop(np.sort(a)[::-1]),
           "by magnitude, largest first": loop(a[np.argsort(-np.abs(a))]),
           "numpy pairwise": float(np.add.reduce(a)), "cumsum": float(np.cumsum(a, dtype=np.float32)[-1]),
           "dot with ones": float(x @ torch.ones_like(x))}
    for chunk in (7, 64, 333):  # micro-batches: partial sums added up
        out[f"chunks of {chunk}"] = loop([np.float32(c.sum()) for c in np.array_split(a, range(chunk, N, chunk))])
    for threads in (1, 2, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out[f"{threads} threads"] = float(x.reshape(8, -1).sum(1).sum())
        finally:
            torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("signed", [False, True], ids=["positive terms", "mixed signs"])
def test_a_float32_sum_in_any_order_is_within_the_bound_of_its_float64_reference(signed):
    x = _terms(signed)
    ref = float(x.double().sum())
    rigorous = float(x.double().abs().sum())  # Σ|x_i|: the bound holds for every order
    sums = _sums_in_other_orders(x)
    assert len(set(sums.values())) > 2  # the orders really do round differently
    for how, s in sums.items():
        assert_close_to_reference(s, ref, dtype=torch.float32, reduction=N, scale=rigorous, msg=how)
        if not signed:  # like-signed terms: the reference's own magnitude is Σ|x_i|, the default scale
            assert_close_to_reference(s, ref, dtype=torch.float32, reduction=N, msg=how)


@pytest.mark.parametrize("signed", [False, True], ids=["positive terms", "mixed signs"])
def test_a_sum_missing_a_term_or_off_by_a_scale_is_outside_the_bound(signed):
    x = _terms(signed)
    ref, scale = float(x.double().sum()), float(x.double().abs().sum())
    typical = int(torch.argsort(x.abs())[N // 2])  # a term of median magnitude
    bugs = {"a term dropped": float(torch.cat([x[:typical], x[typical + 1:]]).sum())}
    if not signed:  # mixed signs: the sum (≈ √n) is small beside Σ|x_i| (≈ n), and so is a relative error of it
        bugs.update({"÷ (n − 1) for a mean's n": float(x.sum()) * N / (N - 1),
                     "1e-3 relative error": float(x.sum()) * (1 + 1e-3),
                     "summed in bfloat16": float(x.bfloat16().sum(dtype=torch.bfloat16))})
    for bug, s in bugs.items():
        with pytest.raises(AssertionError, match="off the float64 reference"):
            assert_close_to_reference(s, ref, dtype=torch.float32, reduction=N, scale=scale, msg=bug)


K = 512


def _matrices() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, K, generator=g), torch.randn(K, 48, generator=g)


def test_a_float32_matmul_any_way_is_within_the_bound_of_its_float64_reference():
    a, b = _matrices()
    ref = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()  # |A|·|B|, per element: rigorous

    def loop(ks) -> torch.Tensor:
        out = torch.zeros(64, 48)
        for k in ks:
            out += a[:, k : k + 1] * b[k : k + 1, :]
        return out

    ways = {"torch.matmul": a @ b, "transposed": (b.t() @ a.t()).t(), "einsum": torch.einsum("ik,kj->ij", a, b),
            "loop over k": loop(range(K)), "loop over k backwards": loop(reversed(range(K))),
            "numpy": torch.from_numpy(a.numpy() @ b.numpy()),
            "k in chunks of 100": sum((a[:, i : i + 100] @ b[i : i + 100] for i in range(0, K, 100)), torch.zeros(64, 48)),
            "row by row": torch.stack([a[i] @ b for i in range(64)])}
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            ways[f"{threads} threads"] = torch.mm(a, b)
        finally:
            torch.set_num_threads(before)
    assert len({w.numpy().tobytes() for w in ways.values()}) > 2  # the ways really do round differently
    for how, c in ways.items():
        assert c.dtype == torch.float32
        assert_close_to_reference(c, ref, dtype=torch.float32, reduction=K, scale=scale, msg=how)
        assert_close_to_reference(c, ref, dtype=torch.float32, reduction=K, msg=how)  # the default, per-tensor scale


def test_a_matmul_missing_a_term_scaled_wrong_or_run_in_bfloat16_is_outside_the_bound():
    a, b = _matrices()
    ref = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    keep = torch.arange(K) != 17
    bugs = {"inner index 17 dropped": a[:, keep] @ b[keep],
            "1e-3 relative error": (a @ b) * (1 + 1e-3),
            "one element 1e-3 off": (a @ b).index_put((torch.tensor([5]), torch.tensor([7])), (a[5] @ b[:, 7]) * (1 + 1e-3)),
            "bfloat16 arithmetic": (a.bfloat16() @ b.bfloat16()).float()}
    for bug, c in bugs.items():
        with pytest.raises(AssertionError, match="off the float64 reference"):
            assert_close_to_reference(c, ref, dtype=torch.float32, reduction=K, msg=bug)
    for bug in ("inner index 17 dropped", "bfloat16 arithmetic"):
        with pytest.raises(AssertionError, match="off the float64 reference"):
            assert_close_to_reference(bugs[bug], ref, dtype=torch.float32, reduction=K, scale=scale, msg=bug)
    # what bfloat16 arithmetic is allowed: its own unit roundoff (here n·u = 2 is past any bound, so a short sum)
    short = slice(0, 32)
    assert_close_to_reference((a[:, short].bfloat16() @ b[short].bfloat16()).float(), a[:, short].bfloat16().double()
                              @ b[short].bfloat16().double(), dtype=torch.bfloat16, reduction=32,
                              scale=a[:, short].bfloat16().double().abs() @ b[short].bfloat16().double().abs())


def test_the_assertion_checks_dtypes_shapes_and_non_finite_values():
    ref = torch.tensor([1.0, math.inf, math.nan], dtype=torch.float64)
    assert assert_close_to_reference(torch.tensor([1.0, math.inf, math.nan]), ref, dtype=torch.float32, reduction=4) == 0
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_reference(torch.tensor([1.0, -math.inf, math.nan]), ref, dtype=torch.float32, reduction=4)
    with pytest.raises(AssertionError, match="off the float64 reference"):  # nan where the reference is finite
        assert_close_to_reference(torch.tensor([math.nan, math.inf, math.nan]), ref, dtype=torch.float32, reduction=4)
    with pytest.raises(TypeError, match="float64"):
        assert_close_to_reference(torch.ones(3), torch.ones(3), dtype=torch.float32, reduction=4)
    with pytest.raises(TypeError, match="exactly"):
        assert_close_to_reference(torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.float64),
                                  dtype=torch.float32, reduction=4)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_to_reference(torch.ones(3), torch.ones(1, 3, dtype=torch.float64), dtype=torch.float32, reduction=4)
    zero = torch.zeros(3, dtype=torch.float64)  # an exactly-zero reference allows only exact zeros (no terms, no error)
    with pytest.raises(AssertionError, match="off the float64 reference"):
        assert_close_to_reference(torch.tensor([0.0, 1e-30, 0.0]), zero, dtype=torch.float32, reduction=4)


def test_float64_reference_keeps_the_codes_float32_casts_in_float64():
    from model.decoder import Decoder
    from tests.conftest import debug_config

    x64, x16 = torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float16)
    with float64_reference():
        assert x64.float().dtype == torch.float64 and x16.float().dtype == torch.float32
    assert x64.float().dtype == torch.float32  # restored
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=True)).float().eval()
    ids = torch.randint(3, 99, (3, 11))
    with torch.no_grad():
        logits, _ = model(ids)
        with float64_reference():
            exact, _ = model.double()(ids)
    assert logits.dtype == torch.float32 and exact.dtype == torch.float64
    assert_close_to_reference(logits, exact, dtype=torch.float32, **decoder_rounding(model.config, 33, backward=False))


def test_two_float32_paths_agree_to_twice_the_bound_and_a_dropped_term_does_not():
    """Where no float64 reference can be had (multi-process runs): the two orders against each other."""
    x = _terms(signed=False)
    sums = _sums_in_other_orders(x)
    for how, s in sums.items():
        assert_paths_agree(s, sums["torch.sum"], dtype=torch.float32, reduction=N, msg=how)
    with pytest.raises(AssertionError, match="off the other path"):
        assert_paths_agree(float(x[1:].sum()), sums["torch.sum"], dtype=torch.float32, reduction=N)


def test_a_chain_of_unlike_stages_multiplies_their_factors():
    g = [gamma(n, torch.float32) for n in (300, 8192, 1)]
    chained = relative_bound(torch.float32, [(300, 67), (8192, 1), (1, 2)])
    assert chained == pytest.approx((1 + g[0]) ** 67 * (1 + g[1]) * (1 + g[2]) ** 2 - 1, rel=1e-9)
    assert relative_bound(torch.float32, [(300, 67)]) == relative_bound(torch.float32, 300, 67)
    with pytest.raises(ValueError, match="depth left at 1"):
        relative_bound(torch.float32, [(300, 2)], depth=3)
