"""The suite's one rule for floating-point assertions (issue 39): compare a low-precision result against the same
quantity computed in float64, with a bound derived from the dtype's unit roundoff and the length of the reductions
behind each value -- never a fixed absolute tolerance tuned on one machine, which fails on a CPU or GPU that sums in
another order (another BLAS, vector width, thread count or micro-batch split).

The bound (`relative_bound`, `error_bound`)
------------------------------------------
u = torch.finfo(dtype).eps / 2 is the unit roundoff of the precision the arithmetic runs in, and
γ_n = n·u / (1 − n·u). The standard forward-error bounds (Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., Lemma 3.1, eq. 3.5 and §4.2) hold for *every* order of evaluation -- left to right, pairwise, blocked,
split across threads or micro-batches, with or without FMA:

    sum of n terms          |fl(Σ x_i) − Σ x_i|        ≤ γ_n · Σ |x_i|
    inner product, matmul   |fl(A·B) − A·B|            ≤ γ_n · |A|·|B|        (n: the inner dimension)
    chain of k products     |fl(A_1···A_k) − A_1···A_k| ≤ ((1 + γ_n)^k − 1) · |A_1|···|A_k|   (Higham §3.5)

So a value computed by a chain of `depth` rounding stages (reductions, and elementwise ops charged as if they were
reductions), each over at most `reduction` terms, is within

    bound = ((1 + γ_n)^depth − 1) · scale  +  the same with float64's u (the reference's own error, ~1e-16 relative)

of the exact value, where `scale` is |A_1|···|A_k| (for a plain sum, Σ|x_i|); a chain of unlike stages, k_i of n_i
terms each, gets Π_i (1 + γ_{n_i})^{k_i} − 1 in place of the first factor. The float64 reference is that exact
value for every practical purpose. Nothing in it depends on the order the machine chose: a float32 result that
passes on one machine passes on any other whose arithmetic is IEEE float32 (or better). `dtype` is the precision the
arithmetic actually runs in: a float32 matmul on a GPU with TF32 enabled runs in TF32 (u = 2^-11), not float32.

The scale
---------
Where the terms' magnitudes are known per element (a sum you can also sum in absolute value; `A.abs() @ B.abs()`
for a matmul), pass them as `scale`: the bound is then rigorous. Where they are not (a gradient at the end of a
network: the |A_1|···|A_k| products are not computed by anyone), the default `scale` is the reference's largest
magnitude over the tensor, max|reference|. That is not a rigorous stand-in: an element whose terms cancel heavily
has Σ|terms| above max|Σ terms|. It is safe in practice because the worst-case γ_n charges n·u per reduction, all
n rounding errors at their maximum and of one sign, while rounding errors of real computations are close to
independent and grow like √n·u (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J.
Sci. Comput. 2019: λ·√n·u with probability ≥ 1 − 2n·exp(−λ²/2)); likewise a chain's errors grow like √depth, not
depth. The factor √(n·depth) between the two covers cancellation (Σ|terms| / max|Σ terms|) of that size -- ≈ 110
for the trainer's step of tests/unit/test_trainer.py (n = 192 positions, depth 67). Measured there: float32 gradients
of every micro-batch splitting are within ≈ 40·u·max|ref| of the float64 reference, under 0.5 % of the bound
≈ 1.3e4·u·max|ref| (≈ 8e-4 of the tensor's largest element). Elementwise functions that a GPU only approximates
(fast exp / log: a few ulp) are covered by charging each of them a whole γ_n.

It is not vacuous: it stays a small fraction of the values (the helpers refuse a bound ≥ 1, which would accept
anything), so a genuine bug of realistic size exceeds it: in the trainer's step, a loss normalised by a token count
off by one in 65 (1.5 %: 20-30× the bound), a dropped micro-batch or row, padding that leaks into the loss, bfloat16
autocast (about 100× the bound); a 1e-3 relative error is at its edge there (1-3×), and far outside it for the sums and
matmuls of tests/unit/test_numerics.py, which shows both sides: every order accepted, every bug rejected.

Exactness is a separate rule: integer and bit-level results, copies, and code paths designed to be bit-identical
(e.g. QAT fake-quant vs the engine's quantisation) keep exact comparisons (`torch.equal`, rtol=0, atol=0).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

__all__ = ["unit_roundoff", "gamma", "relative_bound", "error_bound", "assert_close_to_reference",
           "assert_paths_agree", "float64_reference", "decoder_rounding"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to nearest in `dtype` (2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """γ_n = n·u / (1 − n·u): the relative forward-error bound of a sum or inner product of n terms, any order."""
    if n < 1:
        raise ValueError(f"a reduction has at least one term, got {n}")
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"n·u = {nu:.3g} >= 1: no error bound for {n}-term reductions in {dtype}")
    return nu / (1 - nu)


Stages = int | Sequence[tuple[int, int]]
"""A chain's reductions: n (every stage of `depth` at most n terms), or (n_i, k_i) pairs, k_i stages of n_i terms."""


def relative_bound(dtype: torch.dtype, reduction: Stages, depth: int = 1) -> float:
    """(1 + γ_n)^depth − 1 for n = `reduction`: the error of a chain of `depth` rounding stages, each a reduction of
    at most n terms, relative to the product of its terms' magnitudes (the module docstring); for a chain of unlike
    stages, `reduction` = [(n_1, k_1), (n_2, k_2), ...] gives Π_i (1 + γ_{n_i})^{k_i} − 1 (leave depth at 1).
    Refuses a bound ≥ 1: one that large would accept any value of the right sign."""
    if depth < 1:
        raise ValueError(f"depth counts rounding stages, at least 1, got {depth}")
    if isinstance(reduction, int):
        stages = [(reduction, depth)]
    elif depth != 1:
        raise ValueError("give a chain of unlike stages as (terms, count) pairs, with depth left at 1")
    else:
        stages = list(reduction)
    b = math.expm1(sum(k * math.log1p(gamma(n, dtype)) for n, k in stages))
    if b >= 1:
        raise ValueError(f"the bound {b:.3g} of {stages} in {dtype} is >= 1: vacuous")
    return b


def error_bound(reference: torch.Tensor | float, *, dtype: torch.dtype, reduction: Stages, depth: int = 1,
                scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """The largest |actual − reference| allowed, per element (broadcast against `reference`): `relative_bound` ×
    `scale`, plus the float64 reference's own error. `scale`: the magnitude of the terms behind each element
    (Σ|x_i|, |A|·|B|), a tensor broadcastable to `reference` or a number; default max|reference| over the tensor."""
    ref = torch.as_tensor(reference, dtype=torch.float64)
    if scale is None:
        finite = ref[torch.isfinite(ref)]
        s = finite.abs().max() if finite.numel() else torch.zeros((), dtype=torch.float64)
    else:
        s = torch.as_tensor(scale, dtype=torch.float64, device=ref.device).abs()
    rel = relative_bound(dtype, reduction, depth) + relative_bound(torch.float64, reduction, depth)
    return torch.broadcast_to(rel * s, ref.shape)


def assert_close_to_reference(actual: torch.Tensor | float, reference: torch.Tensor | float, *, dtype: torch.dtype,
                              reduction: Stages, depth: int = 1, scale: torch.Tensor | float | None = None,
                              msg: object = "", _paths: float = 1) -> float:
    """Assert that `actual`, computed in `dtype`, is within `error_bound` of `reference`, the same quantity computed
    in float64 from the same inputs (e.g. the model `.double()`; `float64_reference` where the code casts down).

    reduction: the number of terms of the longest reduction behind any element (a sum's length, a matmul's inner
    dimension, the positions a weight's gradient sums over), or a chain of unlike stages (`relative_bound`). depth: the
    number of rounding stages chained behind it (1 for a sum or a matmul; `decoder_rounding` counts a decoder's).
    scale: `error_bound`'s. Non-finite reference
    elements must be matched exactly (the same infinity, or nan). Returns the worst |actual − reference| / bound
    (≤ 1; 0 where both are exact), for a test that wants to show how much room there is."""
    if isinstance(reference, torch.Tensor) and reference.dtype != torch.float64:
        raise TypeError(f"the reference must be computed in float64, got {reference.dtype}")
    ref = torch.as_tensor(reference, dtype=torch.float64)
    act = torch.as_tensor(actual).to(device=ref.device)
    if not act.dtype.is_floating_point:
        raise TypeError(f"actual is {act.dtype}: integer results are compared exactly, not with a bound")
    act = act.to(torch.float64)  # exact: float32 / bf16 / fp16 values are float64 values
    where = f"{msg}: " if msg != "" else ""
    if act.shape != ref.shape:
        raise AssertionError(f"{where}shape {tuple(act.shape)} != the reference's {tuple(ref.shape)}")
    finite = torch.isfinite(ref)
    same_special = (act == ref) | (torch.isnan(act) & torch.isnan(ref))
    if not bool(same_special[~finite].all()):
        raise AssertionError(f"{where}non-finite reference values not matched: {act[~finite & ~same_special][:8].tolist()}"
                             f" vs {ref[~finite & ~same_special][:8].tolist()}")
    bound = _paths * error_bound(ref, dtype=dtype, reduction=reduction, depth=depth, scale=scale)
    err = torch.where(finite, (act - ref).abs(), torch.zeros_like(ref))
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)  # a nan where the reference is finite
    over = err > bound
    ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)  # inf where the bound is 0 (a zero reference)
    if bool(over.any()):
        i = int(torch.argmax(torch.where(over, ratio, torch.zeros_like(ratio)).reshape(-1)))
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), ref.shape)) if ref.dim() else ()
        e, b = float(err.reshape(-1)[i]), float(bound.reshape(-1)[i])
        raise AssertionError(
            f"{where}{int(over.sum())} of {ref.numel()} elements off {'the float64 reference' if _paths == 1 else 'the other path'} "
            f"by more than the bound; "
            f"worst at {idx}: actual {float(act.reshape(-1)[i])!r}, reference {float(ref.reshape(-1)[i])!r}, "
            f"|error| {e:.3g} > bound {b:.3g} ({e / b if b else math.inf:.3g}× it) = "
            f"{f'{_paths:.3g}·' if _paths != 1 else ''}((1 + γ_n)^depth − 1)·scale with "
            f"u = {unit_roundoff(dtype):.3g} ({dtype}), n = {reduction}, depth = {depth}")
    return float(ratio.max()) if ratio.numel() else 0.0


def assert_paths_agree(a: torch.Tensor | float, b: torch.Tensor | float, *, dtype: torch.dtype, reduction: Stages,
                       depth: int = 1, scale: torch.Tensor | float | None = None, msg: object = "") -> float:
    """Two computations of one quantity in `dtype` that sum in different orders (micro-batches, ranks, kernels),
    where no float64 reference can be computed (e.g. a multi-process run, or float32-only kernels on the way): each
    is within β · scale of the exact value (β = `relative_bound`), so |a − b| ≤ 2β · scale. Default scale: `b`'s
    magnitude (max|b| per tensor), which is within a factor (1 − β) of the exact value's: the bound used is
    2β / (1 − β) · max|b|. Prefer `assert_close_to_reference` wherever the float64 reference can be had."""
    beta = relative_bound(dtype, reduction, depth)
    b64 = torch.as_tensor(b).to(torch.float64) if isinstance(b, torch.Tensor) else float(b)
    return assert_close_to_reference(a, b64, dtype=dtype, reduction=reduction, depth=depth, scale=scale, msg=msg,
                                     _paths=2 / (1 - beta))


@contextlib.contextmanager
def float64_reference() -> Iterator[None]:
    """Within it, `Tensor.float()` leaves float64 tensors in float64 (other dtypes convert as usual).

    The model and the losses cast to float32 on purpose in places (RMSNorm and RoPE in float32 as transformers
    computes them, `Decoder.logits`, the log-softmax of the objectives): with a `.double()` model those casts would
    put float32 roundings back into the float64 reference. This keeps the same code, on the same (exactly converted)
    inputs, in float64 throughout. Constants the code builds from integers in float32 (RoPE's inverse frequencies and
    cos/sin tables) stay float32 values -- inputs of the computation that the float32 run uses identically.
    For a reference only: never around the code under test."""
    original = torch.Tensor.float

    def keep_float64(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = keep_float64
    try:
        yield
    finally:
        torch.Tensor.float = original


DENSE_LAYER_STAGES = 14
"""Rounding stages chained through one dense decoder layer's forward (model/decoder.py): input RMSNorm (mean of
squares, rsqrt, scale), the q/k/v projections, qk-norm, RoPE, the scores q·k, the softmax's normaliser, the
probabilities × v, o_proj, the residual add, the post-attention RMSNorm, gate/up, silu(gate)·up, down_proj, the
residual add: each charged a full γ_n (elementwise ones need only γ_1: generous)."""
MOE_EXTRA_STAGES = 4
"""A MoE layer's additions to a dense layer's chain: the router's logits and softmax, the top-k renormalisation,
the weighted sum of the k experts."""
HEAD_STAGES = 5
"""After the layers: the final RMSNorm, lm_head, the log-softmax (max, exp-sum, log), the gather and the loss's
masked sum ÷ the token count."""


def decoder_rounding(config, positions: int, *, backward: bool) -> dict[str, int]:
    """`reduction` and `depth` for a decoder's training step (dense or MoE attention; not CSA2): of its loss and
    metrics (backward=False: the forward chain), or of its parameters' gradients (backward=True: the forward chain,
    the backward chain through the same stages, and the sum over `positions` into each weight's gradient).

    positions: the packed positions the step sums over, padding included (B × T over the step's micro-batches;
    a padded position's terms are exact zeros, so counting it only loosens the bound). The longest reduction is
    that, or the widest layer's inner dimension (vocabulary, FFN, hidden, attention width)."""
    if getattr(config, "is_sparse", False):
        raise ValueError("decoder_rounding counts dense and MoE attention, not CSA2's indexer")
    ffn = config.ffn
    widths = [config.hidden_size, config.vocab_size, config.num_heads * config.head_dim,
              getattr(ffn, "intermediate_size", 0) or 0,
              (getattr(ffn, "moe_intermediate_size", 0) or 0) * max(1, getattr(ffn, "num_shared_experts", 0) or 0),
              getattr(ffn, "num_experts", 0) or 0]
    per_layer = DENSE_LAYER_STAGES + (MOE_EXTRA_STAGES if config.is_moe else 0)
    forward = per_layer * config.num_layers + HEAD_STAGES
    return {"reduction": max([positions, *widths]), "depth": 2 * forward + 1 if backward else forward}
