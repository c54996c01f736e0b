"""Memory and time of the trained tokens' log-probs and entropy (model/token_logprobs.py) against materialised
logits, for one long micro-batch: the increase of the device's peak allocated memory over the forward and backward,
the output head's gradient excluded (its [V, d] float32 sum and the cast to the head's dtype are the head's
gradient, which any path produces).

    python bench/logprob_memory.py --quick         # CPU, small: the plumbing (time only; CPU has no peak counter)
    python bench/logprob_memory.py                 # GPU: 65,536 tokens, vocab 151,936, hidden 2,048, bf16

Last line: RESULT tokens=.. vocab=.. impls=.. extra_gib=.. ms=..
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.token_logprobs import token_logprobs  # noqa: E402


def measure(impl: str, n: int, d: int, V: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(n, d, device=device, dtype=dtype, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(V, d, device=device, dtype=dtype, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (n,), device=device, generator=g)
    head_grad = V * d * (4 + (0 if dtype == torch.float32 else torch.finfo(dtype).bits // 8))
    times = []
    extra = float("nan")
    for i in range(3):
        h.grad = w.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        lp, ent = token_logprobs(h, w, targets, 0.9, entropy=True, impl=impl)
        (lp.sum() + 0.1 * ent.sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
            # the inputs' gradients (h's [n, d], w's) stay; the head's own gradient buffers are excluded
            extra = (torch.cuda.max_memory_allocated() - base - head_grad) / 2**30
        times.append(time.perf_counter() - t0)
        del lp, ent
    return extra, min(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--impls", default="triton,reference")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.quick else "cpu"
    if a.quick:
        a.tokens, a.vocab, a.hidden, a.impls = 2048, 4096, 64, "torch,reference"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for impl in a.impls.split(","):
        try:
            extra, ms = measure(impl, a.tokens, a.hidden, a.vocab, device, dtype)
        except torch.OutOfMemoryError:
            extra, ms = float("inf"), float("nan")
            torch.cuda.empty_cache()
        rows.append((impl, extra, ms))
        print(f"{impl:>10s}: {extra:8.2f} GiB beyond the inputs and the head's gradient, {ms:8.1f} ms forward+backward",
              flush=True)
    print(f"RESULT tokens={a.tokens} vocab={a.vocab} hidden={a.hidden} impls={','.join(r[0] for r in rows)} "
          f"extra_gib={','.join('%.2f' % r[1] for r in rows)} ms={','.join('%.1f' % r[2] for r in rows)}")


if __name__ == "__main__":
    main()
