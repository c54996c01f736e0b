"""Full-vocabulary OPD loss: reverse KL from the student to its teacher (seed §5.2.4; issue #6, item 3).

At every response position i of the student's own sample, with student logits z_s = h_s W_sᵀ and
teacher logits z_t = h_t W_tᵀ over the same vocabulary (the teacher may have another hidden size):

    KL_i = Σ_v p_s(v) (log p_s(v) - log p_t(v)),   p = softmax(z)
    loss = Σ_i weight_i · KL_i / normalizer
    ∂KL_i/∂z_s = p_s ⊙ (log p_s - log p_t - KL_i)                 (per token, full vocabulary)

Only the student learns: no gradient reaches h_t or W_t. Three implementations, one contract:

- `reverse_kl_reference`: materialises both [T, V] logit tensors in float32 and lets autograd do the
  rest. For tests and as the "naive" baseline of bench/opd_loss.py.
- `impl="torch"` / `impl="triton"`: a custom autograd Function that walks the tokens in chunks of
  `chunk_size`, like Liger's fused-linear losses. Per chunk: one matmul into a reusable [chunk, V]
  student-logit buffer; the teacher's logits in sub-chunks of `teacher_chunk_size` tokens into a
  second, smaller buffer, each followed by the per-row KL and logit gradient (a Triton kernel,
  `model/kernels/reverse_kl.py`, writing the gradient in place over the student logits; or plain
  torch); then grad_h_s[chunk] = g W_s and grad_W_s += gᵀ h_s[chunk], accumulated in the output-head
  gradient buffer itself. The gradients are thus computed in the forward pass and only scaled by
  grad_output in backward; no [T, V] tensor ever exists. Peak extra memory ≈ (chunk_size +
  teacher_chunk_size) · V logits (+ the [T, Hs] hidden-state gradient), independent of T. The
  teacher split exists because W_s's gradient matmul has K = chunk_size: a long student chunk keeps
  it efficient, and the teacher buffer need not be as long.

Logits are held in the input dtype by default (bf16 logits upcast per element to fp32 inside the
kernel, the same rounding as the reference's `(h @ Wᵀ).float()`); `logits_dtype=torch.float32` asks the
matmul for fp32 output instead (twice the buffer memory, no bf16 rounding of logits).
Tokens with weight 0 (prompt or tool-output positions under a response mask) are dropped before the
matmuls, so they cost nothing; their per-token KL is reported as 0.
"""

from __future__ import annotations

import torch

IMPLS = ("auto", "triton", "torch", "reference")
DEFAULT_CHUNK_BYTES = 384 * 2**20  # the two logit buffers together; see default_chunk_sizes


def reverse_kl_reference(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor, w_t: torch.Tensor,
                         weights: torch.Tensor | None = None, normalizer: float | torch.Tensor = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reverse KL (seed §5.2.4), materialising float32 [T, V] log-probs of both models.

    h_s [T, Hs], w_s [V, Hs], h_t [T, Ht], w_t [V, Ht], weights [T] or None (all ones).
    Returns (loss = Σ_i weight_i·KL_i / normalizer, per-token KL [T] detached, 0 where weight is 0).
    """
    logp_s = torch.log_softmax((h_s @ w_s.t()).float(), dim=-1)
    logp_t = torch.log_softmax((h_t.detach() @ w_t.detach().t()).float(), dim=-1)
    kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    if weights is None:
        return kl.sum() / normalizer, kl.detach()
    w = weights.to(device=kl.device, dtype=torch.float32)
    return (kl * w).sum() / normalizer, torch.where(w != 0, kl.detach(), 0.0)


def default_chunk_sizes(vocab: int, logits_dtype: torch.dtype, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, int]:
    """(chunk_size, teacher_chunk_size): the student's [chunk, V] logit/gradient buffer and the teacher's
    [chunk / 2, V] buffer fit `budget_bytes` together; multiples of 64, at least 64 and 32. At V = 128256
    in bf16: (1024, 512), 376 MiB of buffers. On the H200 (bench/opd_loss.py, T = 8192, H = 4096,
    2026-11-30) that measured 0.430 GiB beyond the output-head gradient in 57.4 ms; (512, 512) 0.307 GiB
    in 62.4 ms; (1024, 1024) 0.552 GiB in 56.8 ms. The longer student chunk is what pays: W_s's
    gradient matmul has K = chunk_size and re-reads the accumulated gradient once per chunk."""
    per_token = 3 * vocab * torch.finfo(logits_dtype).bits // 8 // 2
    chunk = max(64, budget_bytes // per_token // 64 * 64)
    return chunk, chunk // 2


def _logits_into(buf: torch.Tensor, h: torch.Tensor, w: torch.Tensor, w_up: torch.Tensor | None) -> None:
    """buf [n, V] <- h [n, H] @ w [V, H]ᵀ, rounded once to buf's dtype."""
    if h.dtype == w.dtype == buf.dtype:
        torch.mm(h, w.t(), out=buf)
    elif buf.dtype == torch.float32 and h.dtype == w.dtype and h.is_cuda:
        torch.mm(h, w.t(), out_dtype=torch.float32, out=buf)  # fp32 accumulate, no bf16 rounding
    elif w_up is not None:  # CPU has no mm(out_dtype=): an fp32 copy of w, made once per call
        torch.mm(h.float(), w_up.t(), out=buf)
    else:
        ct = torch.promote_types(h.dtype, w.dtype)
        buf.copy_(h.to(ct) @ w.to(ct).t())


def _upcast_head(h: torch.Tensor, w: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor | None:
    """The fp32 copy of a low-precision head that `_logits_into` needs for fp32 logits off CUDA."""
    if logits_dtype != torch.float32 or w.dtype == torch.float32 or (h.is_cuda and h.dtype == w.dtype):
        return None
    return w.float()


def _chunk_torch(zs: torch.Tensor, zt: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """The kernel's contract in torch: per-row KL [n], and scale·dKL/dz_s written into `grad`."""
    logp_s = torch.log_softmax(zs.float(), dim=-1)
    gap = torch.log_softmax(zt.float(), dim=-1)
    torch.sub(logp_s, gap, out=gap)  # log p_s - log p_t, in the teacher's buffer
    p_s = logp_s.exp_()
    kl = (p_s.unsqueeze(1) @ gap.unsqueeze(2)).view(-1)  # Σ_v p_s·gap without another [n, V]
    if grad is not None:
        grad.copy_(gap.sub_(kl[:, None]).mul_(p_s).mul_(scale[:, None]))
    return kl


class _ChunkedReverseKL(torch.autograd.Function):
    """Loss and per-token KL over token chunks; gradients computed in forward (Liger-style)."""

    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, scale, chunk_size: int, teacher_chunk_size: int, use_triton: bool,
                logits_dtype, block_v):
        T, V = h_s.shape[0], w_s.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = logits_dtype or h_s.dtype
        n_s = max(1, min(chunk_size, T))
        n_t = max(1, min(teacher_chunk_size, n_s))
        # Student logits of a whole chunk in one matmul; they become the logit gradient in place when
        # the dtypes agree (else one more buffer in W_s's dtype, for the two gradient matmuls). The
        # teacher's logits come in sub-chunks of n_t tokens: a smaller second buffer, while the
        # gradient matmuls (whose K is the chunk length for W_s) keep the whole chunk.
        zs_buf = torch.empty(n_s, V, dtype=dtype, device=h_s.device)
        zt_buf = torch.empty(n_t, V, dtype=dtype, device=h_s.device)
        want_grad = want_h or want_w
        g_buf = zs_buf if (dtype == w_s.dtype or not want_grad) else torch.empty(n_s, V, dtype=w_s.dtype, device=h_s.device)
        ws_up, wt_up = _upcast_head(h_s, w_s, dtype), _upcast_head(h_t, w_t, dtype)
        grad_h = torch.empty_like(h_s) if want_h else None
        grad_w = torch.empty_like(w_s) if want_w else None  # the first chunk writes it, later ones add
        if want_w and T == 0:
            grad_w.zero_()
        kl = torch.empty(T, dtype=torch.float32, device=h_s.device)
        if use_triton:
            from model.kernels.reverse_kl import reverse_kl_rows
        for s in range(0, T, n_s):
            e = min(s + n_s, T)
            zs = zs_buf[: e - s]
            _logits_into(zs, h_s[s:e], w_s, ws_up)
            g = g_buf[: e - s] if want_grad else None
            for j in range(0, e - s, n_t):
                k = min(j + n_t, e - s)
                zt = zt_buf[: k - j]
                _logits_into(zt, h_t[s + j:s + k], w_t, wt_up)
                gj = None if g is None else g[j:k]
                if use_triton:
                    reverse_kl_rows(zs[j:k], zt, scale[s + j:s + k], gj, block_v=block_v, out=kl[s + j:s + k])
                else:
                    kl[s + j:s + k] = _chunk_torch(zs[j:k], zt, scale[s + j:s + k], gj)
            if want_h:
                torch.mm(g, w_s, out=grad_h[s:e])
            if want_w:  # accumulated in the output-head gradient itself
                if s == 0:
                    torch.mm(g.t(), h_s[s:e], out=grad_w)
                else:
                    grad_w.addmm_(g.t(), h_s[s:e])
        # kept as plain attributes, not saved tensors: backward hands them to autograd as the only
        # reference, so AccumulateGrad can adopt them as .grad instead of copying (1 GiB for W_s)
        ctx.grads = [grad_h, grad_w]
        ctx.use_triton = use_triton
        ctx.mark_non_differentiable(kl)
        return (kl * scale).sum(), kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # Scale by grad_output, skipped in the common case where this loss is backpropagated unscaled
        # (as Liger's is): on CUDA a kernel checks the scalar on the device (no host sync, so the host
        # can queue the next step); on CPU checking costs nothing.
        for g in (grad_h, grad_w):
            if g is None:
                continue
            if g.is_cuda and ctx.use_triton and g.is_contiguous():
                from model.kernels.reverse_kl import scale_unless_one_

                scale_unless_one_(g, grad_loss)
            elif not torch.equal(grad_loss, torch.ones_like(grad_loss)):
                g.mul_(grad_loss.to(g.dtype))
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def reverse_kl_loss(h_s: torch.Tensor, w_s: torch.Tensor, h_t: torch.Tensor, w_t: torch.Tensor,
                    weights: torch.Tensor | None = None, normalizer: float | torch.Tensor = 1.0, *,
                    impl: str = "auto", chunk_size: int | None = None, teacher_chunk_size: int | None = None,
                    logits_dtype: torch.dtype | None = None, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """OPD reverse KL, loss = Σ_i weight_i · KL(π_s || π_t)_i / normalizer (seed §5.2.4).

    h_s [..., Hs] student final hidden states, w_s [V, Hs] student output head (both get gradients);
    h_t [..., Ht] and w_t [V, Ht] the teacher's (detached). weights [...] per-token (response mask,
    per-sample normaliser...); None means 1 everywhere. Returns (loss: fp32 scalar, per-token KL [...]
    fp32, detached, 0 where the weight is 0).

    impl: "triton" (fused chunk kernel, CUDA or TRITON_INTERPRET=1), "torch" (same chunking, torch ops
    per chunk), "reference" (materialises everything), "auto" (triton on CUDA, else torch).
    chunk_size: tokens whose student logits (then gradients) are held at once; teacher_chunk_size: tokens
    whose teacher logits are held at once (<= chunk_size). Defaults: `default_chunk_sizes`; extra memory
    ≈ (chunk_size + teacher_chunk_size) · V logits. logits_dtype: dtype of the logit buffers (default:
    h_s's dtype). block_v: vocabulary tile of the Triton kernel (default 4096).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    lead = h_s.shape[:-1]
    if h_t.shape[:-1] != lead or (weights is not None and weights.shape != lead):
        raise ValueError(f"token shapes differ: h_s {tuple(h_s.shape)}, h_t {tuple(h_t.shape)}, "
                         f"weights {None if weights is None else tuple(weights.shape)}")
    if w_s.shape[0] != w_t.shape[0] or w_s.shape[1] != h_s.shape[-1] or w_t.shape[1] != h_t.shape[-1]:
        raise ValueError(f"heads do not match: w_s {tuple(w_s.shape)} for h_s [..., {h_s.shape[-1]}], "
                         f"w_t {tuple(w_t.shape)} for h_t [..., {h_t.shape[-1]}] (same vocabulary needed)")
    if impl != "reference" and h_s.dtype != w_s.dtype:
        raise ValueError(f"student hidden states ({h_s.dtype}) and head ({w_s.dtype}) must share a dtype")
    hs, ht = h_s.reshape(-1, h_s.shape[-1]), h_t.detach().reshape(-1, h_t.shape[-1])
    w = None if weights is None else weights.reshape(-1)
    if impl == "reference":
        loss, kl = reverse_kl_reference(hs, w_s, ht, w_t, w, normalizer)
        return loss, kl.view(lead)
    if impl == "auto":
        impl = "triton" if h_s.is_cuda else "torch"
    scale = torch.ones(hs.shape[0], dtype=torch.float32, device=hs.device) if w is None else w.float()
    scale = scale / normalizer
    T = hs.shape[0]
    keep = None
    if w is not None:
        keep = torch.nonzero(w).view(-1)  # host sync: fine once per loss call
        if keep.numel() == T:
            keep = None
        else:
            hs, ht, scale = hs[keep], ht[keep], scale[keep]
    chunk, teacher_chunk = default_chunk_sizes(w_s.shape[0], logits_dtype or hs.dtype)
    chunk = chunk_size or chunk
    teacher_chunk = teacher_chunk_size or min(chunk, teacher_chunk if chunk_size is None else chunk)
    loss, kl = _ChunkedReverseKL.apply(hs.contiguous(), w_s, ht.contiguous(), w_t.detach(), scale, chunk,
                                       teacher_chunk, impl == "triton", logits_dtype, block_v)
    if keep is not None:
        kl = torch.zeros(T, dtype=kl.dtype, device=kl.device).index_copy_(0, keep, kl)
    return loss, kl.view(lead)
