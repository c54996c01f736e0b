"""Log-probs and entropy of the target tokens from hidden states and the output head, chunked over tokens.

The GRPO/SFT objectives need, at every trained position i with final hidden state h_i, target token y_i and
sampling temperature τ (seed §5.2.2: the policy's token log-probs at the temperature it sampled with):

    s_i = (h_i Wᵀ) / τ,   lse_i = log Σ_v exp(s_iv),   lp_i = s_iy - lse_i
    H_i = -Σ_v p_iv log p_iv = lse_i - Σ_v p_iv s_iv,  p_i = softmax(s_i)       (verl's actor/entropy)

and their gradients for a loss L with g_lp = ∂L/∂lp_i and g_H = ∂L/∂H_i:

    ∂L/∂z_iv = ( g_lp·(δ_{v,y} - p_iv) - g_H·p_iv·(log p_iv + H_i) ) / τ,   z = h Wᵀ
    ∂L/∂h_i = Σ_v ∂L/∂z_iv W_v,   ∂L/∂W = Σ_i (∂L/∂z_i)ᵀ h_i

Materialising z costs [tokens, V] float32 twice over (logits and their gradient): 37 GiB at V = 151,936 and
64K tokens. Three implementations of one contract:

- `token_logprobs_reference`: materialises the float32 logits and lets autograd do the rest (tests, baseline).
- `impl="torch"` / `impl="triton"`: a custom autograd Function that walks the tokens in chunks of `chunk_size`.
  Forward: per chunk, one matmul into a single reusable [chunk, V] logit buffer (h's dtype, rounded as the
  reference's `h @ Wᵀ` is), then per row lse, lp and (entropy=True) H in one sweep over V (the Triton kernel
  of `model/kernels/token_logprobs.py` with an online log-sum-exp, or torch ops on the chunk). It saves only
  h, W, the targets, lse [n] and H [n]. Backward: per chunk, the logits again into the buffer, the logit
  gradient above written over them in place, then grad_h[chunk] = g_z W and grad_W += g_zᵀ h[chunk].
  Memory beyond the inputs and the returned gradients is O(chunk × V), independent of the number of tokens
  (the torch impl adds a few float32 [chunk, V] temporaries per chunk; the Triton kernels none). The one other
  buffer is W's gradient accumulated in float32, [V, d]: when W is bf16 a running bf16 sum over the chunks
  would round at every chunk, so the float32 sum is cast to W's dtype once at the end (for an fp32 W it is
  the returned gradient itself).

Unlike the OPD loss (`model/reverse_kl.py`) the gradients cannot be formed in the forward pass: the incoming
g_lp and g_H (the policy loss's advantages and clip masks, the entropy coefficient) are known only in backward,
so each chunk's logits are computed twice. Entropy off: no entropy work anywhere (a constexpr in the kernels).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IMPLS = ("auto", "triton", "torch", "reference")
DEFAULT_CHUNK_BYTES = 512 * 2**20  # the [chunk, V] logit buffer; see default_chunk_size


def token_logprobs_reference(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                             entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((h Wᵀ) / τ) at the targets, and (entropy=True) -Σ_v p log p per row, from materialised
    float32 logits. h [n, d], w [V, d], targets [n]. Returns (logprobs [n] fp32, entropy [n] fp32 or None),
    differentiable in h and w."""
    logp = torch.log_softmax((h @ w.t()).float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.view(-1, 1)).view(-1)
    return lp, (-(logp.exp() * logp).sum(-1) if entropy else None)


def default_chunk_size(vocab: int, dtype: torch.dtype, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that the [chunk, V] logit buffer in `dtype` fits `budget_bytes`: a multiple of 64, at
    least 64. At V = 151936: 1,728 rows in bf16 (501 MiB), 832 in fp32. On the H200 (n = 16384, d = 4096, bf16,
    entropy on, 2026-12-03): forward + backward 155 ms at 832 rows, 135 ms at 2048 (W's fp32 gradient is re-read
    once per chunk, so longer chunks pay where memory allows); the materialising reference 178 ms and 46 GiB."""
    per_row = vocab * torch.finfo(dtype).bits // 8
    return max(64, budget_bytes // max(per_row, 1) // 64 * 64)


def _rows_torch(z: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The forward kernel's contract in torch: per-row (lp, lse, H or None) of s = z / τ, fp32 [C] each."""
    s = z.float() / temperature  # a new fp32 [C, V] either way: z is left as it is
    lse = torch.logsumexp(s, dim=-1)
    lp = s.gather(-1, targets.view(-1, 1)).view(-1) - lse
    if not entropy:
        return lp, lse, None
    logp = s.sub_(lse[:, None])
    p = logp.exp()
    ent = -(p.unsqueeze(1) @ logp.unsqueeze(2)).view(-1)  # Σ_v p log p without another [C, V]
    return lp, lse, ent


def _grad_rows_torch_(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                      g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, temperature: float) -> None:
    """The backward kernel's contract in torch: z <- dL/dz (module docstring), in place."""
    logp = (z.float() / temperature).sub_(lse[:, None])
    p = logp.exp()
    if g_ent is not None:  # g = -g_H·p·(log p + H)
        g = logp.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
        if g_lp is not None:
            g.sub_(p.mul_(g_lp[:, None]))
    else:  # g = -g_lp·p
        g = p.mul_(-g_lp[:, None])
    if g_lp is not None:
        g.scatter_add_(1, targets.view(-1, 1), g_lp.view(-1, 1))  # + g_lp·δ_{v,y}
    z.copy_(g.div_(temperature))


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(lp [n], H [n] or an empty tensor) over token chunks; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, w, targets, temperature: float, chunk_size: int, use_triton: bool, entropy: bool, block_v):
        n, V = h.shape[0], w.shape[0]
        stats = torch.float64 if h.dtype == torch.float64 else torch.float32  # float64 inputs: exact references
        lp = torch.empty(n, dtype=stats, device=h.device)
        lse = torch.empty_like(lp)
        ent = torch.empty(n if entropy else 0, dtype=stats, device=h.device)
        if use_triton:
            from model.kernels.token_logprobs import token_logprobs_rows
        buf = torch.empty(min(chunk_size, n), V, dtype=h.dtype, device=h.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = buf[: e - s]
            torch.mm(h[s:e], w.t(), out=z)
            if use_triton:
                token_logprobs_rows(z, targets[s:e], temperature, entropy=entropy, logprobs=lp[s:e], lse=lse[s:e],
                                    ent=ent[s:e] if entropy else None, block_v=block_v)
            else:
                lp[s:e], lse[s:e], ent_c = _rows_torch(z, targets[s:e], temperature, entropy)
                if entropy:
                    ent[s:e] = ent_c
        ctx.save_for_backward(h, w, targets, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.use_triton, ctx.entropy, ctx.block_v = (
            temperature, chunk_size, use_triton, entropy, block_v)
        if not entropy:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no zeros to read
        return lp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        h, w, targets, lse, ent = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_ent = g_ent if ctx.entropy else None
        if not (want_h or want_w) or (g_lp is None and g_ent is None):
            return None, None, None, None, None, None, None, None
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        n, V = h.shape[0], w.shape[0]
        tau, chunk = ctx.temperature, ctx.chunk_size
        grad_h = torch.empty_like(h) if want_h else None
        # W's gradient summed in fp32 (module docstring); for an fp32 W this is the returned gradient itself
        grad_w = torch.zeros(V, w.shape[1], dtype=torch.promote_types(w.dtype, torch.float32), device=w.device) \
            if want_w else None
        if ctx.use_triton:
            from model.kernels.token_logprobs import token_logprobs_grad_rows_
        buf = torch.empty(min(chunk, n), V, dtype=h.dtype, device=h.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z, hc = buf[: e - s], h[s:e]
            torch.mm(hc, w.t(), out=z)
            rows = [None if g is None else g[s:e] for g in (lse, ent if g_ent is not None else None, g_lp, g_ent)]
            if ctx.use_triton:
                token_logprobs_grad_rows_(z, targets[s:e], *rows, tau, block_v=ctx.block_v)
            else:
                _grad_rows_torch_(z, targets[s:e], *rows, tau)
            if want_h:
                torch.mm(z, w, out=grad_h[s:e])
            if want_w:
                _accumulate_fp32_(grad_w, z.t(), hc)
        if want_w and w.dtype != grad_w.dtype:
            grad_w = grad_w.to(w.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _accumulate_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, with a and b in fp32 or a lower precision: on CUDA the matmul accumulates and writes
    fp32 itself (out_dtype); elsewhere the operands are upcast (a [V, chunk] fp32 copy: CPU is no hot path)."""
    if a.dtype == acc.dtype:  # fp32 (or a float64 reference's float64)
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def token_logprobs(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                   entropy: bool = False, impl: str = "auto", chunk_size: int | None = None,
                   block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((h Wᵀ) / τ) at the targets and (entropy=True) the entropy -Σ_v p log p per token (seed §5.2.2;
    verl's entropy), without [n, V] logits in forward or backward (module docstring).

    h [n, d] final hidden states, w [V, d] output head (same dtype, fp32 or bf16; both may require grad),
    targets [n] integer ids in [0, V), temperature τ > 0. Returns (logprobs [n] fp32, entropy [n] fp32 or None),
    differentiable in h and w.

    impl: "triton" (row kernels, CUDA or TRITON_INTERPRET=1), "torch" (same chunking, torch ops per chunk),
    "reference" (materialises everything), "auto" (triton on CUDA, else torch). chunk_size: tokens whose logits
    are held at once (default `default_chunk_size`). block_v: vocabulary tile of the Triton kernels (default 4096).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
        raise ValueError(f"expected h [n, d] and w [V, d], got h {tuple(h.shape)} and w {tuple(w.shape)}")
    if targets.shape != (h.shape[0],) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer ids [{h.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    targets = targets.to(device=h.device, dtype=torch.int64).contiguous()
    if impl == "reference":
        return token_logprobs_reference(h, w, targets, temperature, entropy)
    if h.dtype != w.dtype:
        raise ValueError(f"hidden states ({h.dtype}) and head ({w.dtype}) must share a dtype")
    if impl == "auto":
        impl = "triton" if h.is_cuda else "torch"
    chunk = chunk_size or default_chunk_size(w.shape[0], h.dtype)
    lp, ent = _ChunkedTokenLogprobs.apply(h.contiguous(), w.contiguous(), targets, float(temperature), chunk,
                                          impl == "triton", entropy, block_v)
    return lp, (ent if entropy else None)
