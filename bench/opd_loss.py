"""OPD reverse-KL loss: fused chunked kernel vs naive vs Liger (issue #6, item 3; seed §5.2.4).

    python bench/opd_loss.py [--quick] [--tokens 8192 --hidden 4096 --vocab 128256 --dtype bf16]
                             [--chunk-size N --teacher-chunk-size M] [--sweep 1024:512,768:768]
                             [--kernel-sweep] [--profile] [--out r.json]

One forward + backward of loss = Σ_i KL(π_s || π_t)_i with gradients to the student hidden states and
output head (teacher detached), for
- fused:   model.reverse_kl, impl="triton" on CUDA (impl="torch", the same chunking with torch ops per
           chunk, on CPU, where the Triton interpreter is far too slow to time);
- chunked-torch (CUDA only): impl="torch";
- naive:   the reference, float32 log-softmax of both [T, V] logit tensors, autograd;
- matmul-floor (CUDA): the four [T, V]-sized matmuls (two logits, two gradients) alone, unchunked;
- liger:   Liger-Kernel's LigerFusedLinearJSD(jsd_beta=1.0), if importable (CUDA only). Its beta=1 branch
           is loss = Σ_v q·(log q - log p) with q the student (its `_input`): KL(student || teacher), but
           averaged over tokens, so its loss is compared ×T.

Peak extra memory: CUDA: torch.cuda.max_memory_allocated() during one forward+backward minus
memory_allocated() just before it (inputs present, .grad cleared, warm-up done) minus the bytes of the
output-head gradient (V·Hs·elem) that every method must produce. The hidden-state gradient [T, Hs]
counts as extra. CPU: the same, with the peak taken from the running sum of the CPU allocator's allocation and free
events (bytes, time-ordered) recorded by torch.profiler(profile_memory=True) during the step (read from
its event tree, `experimental_event_tree`); Python objects are not counted.
Time: mean wall time of forward+backward (CUDA events / perf_counter), .grad reset between iterations.
Last line: RESULT mem_ratio_naive_over_fused=<x> time_ratio_fused_over_naive=<y>
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from model.reverse_kl import default_chunk_sizes, reverse_kl_loss

GiB = 2**30


def _inputs(T, Hs, Ht, V, dtype, device, seed=0):
    """Student leaves (h_s, W_s) and a teacher near the student (KL ~ 0.1-1 nats/token), Ht may differ."""
    g = torch.Generator(device=device).manual_seed(seed)
    h_s = torch.randn(T, Hs, device=device, generator=g)
    w_s = torch.randn(V, Hs, device=device, generator=g) * (2.0 / Hs**0.5)
    h_t = torch.randn(T, Ht, device=device, generator=g)
    h_t[:, : min(Hs, Ht)] += h_s[:, : min(Hs, Ht)] * 2
    w_t = torch.randn(V, Ht, device=device, generator=g) * (0.5 / Ht**0.5)
    w_t[:, : min(Hs, Ht)] += w_s[:, : min(Hs, Ht)] * 0.5
    return (h_s.to(dtype).requires_grad_(), w_s.to(dtype).requires_grad_(), h_t.to(dtype), w_t.to(dtype))


def _make(method, args):
    if method == "fused":
        impl = "triton" if args.device == "cuda" else "torch"
        return lambda hs, ws, ht, wt: reverse_kl_loss(hs, ws, ht, wt, impl=impl, chunk_size=args.chunk_size,
                                                      teacher_chunk_size=args.teacher_chunk_size)[0]
    if method == "chunked-torch":
        return lambda hs, ws, ht, wt: reverse_kl_loss(hs, ws, ht, wt, impl="torch", chunk_size=args.chunk_size,
                                                      teacher_chunk_size=args.teacher_chunk_size)[0]
    if method == "matmul-floor":  # the four [T, V]-sized matmuls alone, unchunked: what no loss can beat
        def floor(hs, ws, ht, wt):
            z = hs.detach() @ ws.detach().t()
            zt = ht @ wt.t()
            gh, gw = z @ ws.detach(), z.t() @ hs.detach()
            del zt, gh, gw
            return (z[:1, :1].float().sum() * 0).requires_grad_()  # nothing to backpropagate

        return floor
    if method == "naive":
        return lambda hs, ws, ht, wt: reverse_kl_loss(hs, ws, ht, wt, impl="reference")[0]
    if method == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=1.0)
        return lambda hs, ws, ht, wt: jsd(hs, ws, ht, wt, None) * hs.shape[0]  # no labels; its loss is a token mean
    raise ValueError(method)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_extra_bytes(step, x, device) -> int:
    """Peak bytes allocated by one step beyond what existed before it, minus the head gradient."""
    head_grad = x[1].numel() * x[1].element_size()
    for t in x[:2]:
        t.grad = None
    _sync(device)
    if device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated() - base - head_grad
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocs, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:  # every allocator event (+bytes / -bytes) of the step, in time order
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, delta in sorted(allocs):
        live += delta
        peak = max(peak, live)
    return peak - head_grad


def _time_s(step, x, device, iters) -> float:
    def one():
        for t in x[:2]:
            t.grad = None
        step()

    one()
    _sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            one()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        one()
    return (time.perf_counter() - t0) / iters


def _measure(method, args, x):
    f = _make(method, args)
    out = {}

    def step():
        out["loss"] = f(*x)
        out["loss"].backward()

    step()  # warm-up: Triton compile, cuBLAS workspace
    mem = _peak_extra_bytes(step, x, args.device)
    t = _time_s(step, x, args.device, args.iters)
    for tt in x[:2]:
        tt.grad = None
    step()
    grads = None if x[0].grad is None else (x[0].grad.clone(), x[1].grad.clone())
    return dict(peak_extra_gib=mem / GiB, time_ms=t * 1e3, loss=out["loss"].item()), grads


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _kernel_sweep(args, V):
    """The Triton chunk kernel alone on [C, V] chunks (C = 256 and 512 rows): time and effective bandwidth
    per config (vocab tile, warps, second-sweep direction, L2 eviction hints)."""
    from model.kernels.reverse_kl import reverse_kl_rows

    rows = []
    configs = [dict(block_v=bv, num_warps=nw) for bv in (2048, 4096, 8192) for nw in (4, 8, 16)]
    configs += [dict(block_v=4096, num_warps=8, reverse=r, l2_hints=h) for r in (False, True) for h in (False, True)]
    for C in (256, 512):
        zs = torch.randn(C, V, device="cuda", dtype=args.torch_dtype) * 3
        zt = zs + torch.randn_like(zs)
        scale = torch.ones(C, device="cuda")
        moved = 5 * zs.numel() * zs.element_size()  # 2 sweeps x 2 rows read + 1 row written
        for cfg in configs:
            t = _time_s(lambda: reverse_kl_rows(zs, zt, scale, zs, **cfg), (), "cuda", 20)
            rows.append(dict(C=C, **cfg, time_ms=t * 1e3, tb_per_s=moved / t / 1e12))
            print(f"kernel C={C} V={V} {cfg}: {t * 1e3:.3f} ms  {moved / t / 1e12:.2f} TB/s")
    return rows


def _breakdown(args, x, iters=20):
    """CUDA: each piece of the fused loop alone (CUDA events, mean of `iters`), the Gw accumulation vs one
    unchunked Gw, and the row kernel beside a teacher matmul on two streams (can they overlap?)."""
    from model.kernels.reverse_kl import reverse_kl_rows

    h_s, w_s, h_t, w_t = (t.detach() for t in x)
    T, V = h_s.shape[0], w_s.shape[0]
    n_s, n_t = args.chunk_size or default_chunk_sizes(V, args.torch_dtype)[0], args.teacher_chunk_size or 256
    zs = torch.empty(n_s, V, dtype=h_s.dtype, device="cuda")
    zt = torch.empty(n_t, V, dtype=h_s.dtype, device="cuda")
    torch.mm(h_s[:n_s], w_s.t(), out=zs)
    torch.mm(h_t[:n_t], w_t.t(), out=zt)
    g = zs[:n_t].clone()
    gw = torch.empty_like(w_s)
    gh = torch.empty(n_s, h_s.shape[1], dtype=h_s.dtype, device="cuda")
    scale = torch.ones(n_t, device="cuda")
    kl = torch.empty(n_t, device="cuda")
    t_ = lambda f: _time_s(f, (), "cuda", iters) * 1e3
    out = {
        f"Ms_{n_s}": t_(lambda: torch.mm(h_s[:n_s], w_s.t(), out=zs)),
        f"Mt_{n_t}": t_(lambda: torch.mm(h_t[:n_t], w_t.t(), out=zt)),
        f"Gh_{n_s}": t_(lambda: torch.mm(zs, w_s, out=gh)),
        f"Gw_{n_s}_first": t_(lambda: torch.mm(zs.t(), h_s[:n_s], out=gw)),
        f"Gw_{n_s}_accumulate": t_(lambda: gw.addmm_(zs.t(), h_s[:n_s])),
        f"K_{n_t}_forward_sweep": t_(lambda: reverse_kl_rows(zs[:n_t], zt, scale, g, out=kl, reverse=False)),
        f"K_{n_t}_reverse_sweep": t_(lambda: reverse_kl_rows(zs[:n_t], zt, scale, g, out=kl, reverse=True)),
    }
    gh = None  # free it (the timed lambdas above read the name)
    side = torch.cuda.Stream()

    def both():
        ev = torch.cuda.current_stream().record_event()
        with torch.cuda.stream(side):
            side.wait_event(ev)
            reverse_kl_rows(zs[:n_t], zt, scale, g, out=kl)
        torch.mm(h_t[:n_t], w_t.t(), out=zt)
        torch.cuda.current_stream().wait_event(side.record_event())

    out[f"Mt_{n_t}_beside_K_{n_t}"] = t_(both)
    steps = T // n_s
    out["loop_estimate_ms"] = steps * (out[f"Ms_{n_s}"] + out[f"Gh_{n_s}"] + out[f"Gw_{n_s}_accumulate"]
                                       + (n_s // n_t) * (out[f"Mt_{n_t}"] + out[f"K_{n_t}_reverse_sweep"]))
    for k, v in out.items():
        print(f"breakdown {k:28s} {v:8.3f} ms")
    return out


def _profile_fused(args, x, iters=3):
    """Per-kernel device time of `iters` fused steps, and their sum against the wall time of the same
    steps (CUDA events): a gap means idle device time, not slow kernels."""
    from torch.profiler import ProfilerActivity, profile

    f = _make("fused", args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(iters):
            for t in x[:2]:
                t.grad = None
            f(*x).backward()
        end.record()
        torch.cuda.synchronize()
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / iters
    wall = start.elapsed_time(end) / iters
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
    print(f"fused: device busy {busy:.2f} ms of {wall:.2f} ms wall per step (profiled, {iters} steps)")
    return dict(busy_ms=busy, wall_ms=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (T=512 H=256 V=8192, chunks 128/64; fp32 on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--teacher-hidden", type=int, default=None, help="default: --hidden")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--chunk-size", type=int, default=None, help="student tokens per chunk (default: model.reverse_kl's)")
    ap.add_argument("--teacher-chunk-size", type=int, default=None, help="teacher tokens per sub-chunk")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--methods", default=None, help="comma list of fused,chunked-torch,naive,liger,matmul-floor")
    ap.add_argument("--sweep", default="", help="extra fused runs at chunk:teacher_chunk sizes, e.g. 1024:512,768:768")
    ap.add_argument("--kernel-sweep", action="store_true", help="CUDA: time the chunk kernel alone per tile config")
    ap.add_argument("--profile", action="store_true", help="CUDA: per-kernel device time of one fused step")
    ap.add_argument("--sweep-rounds", type=int, default=1, help="measure the --sweep configs this many times, "
                    "round-robin (median reported): configs side by side as the GPU warms")
    ap.add_argument("--breakdown", action="store_true", help="CUDA: time each piece of the fused loop alone")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.hidden, a.vocab = 512, 256, 8192
        a.chunk_size = a.chunk_size or 128
        a.teacher_chunk_size = a.teacher_chunk_size or 64
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    a.iters = a.iters or (10 if a.device == "cuda" else 3)
    T, Hs, V = a.tokens, a.hidden, a.vocab
    Ht = a.teacher_hidden or Hs
    methods = a.methods.split(",") if a.methods else (
        ["fused", "chunked-torch", "naive", "liger", "matmul-floor"] if a.device == "cuda" else ["fused", "naive"])
    if "liger" in methods:
        try:
            import liger_kernel.transformers  # noqa: F401
        except ImportError as e:
            print(f"liger: not importable ({e}); skipped")
            methods.remove("liger")
    dc, dtc = default_chunk_sizes(V, a.torch_dtype)
    chunk = (a.chunk_size or dc, a.teacher_chunk_size or (a.chunk_size or dtc if a.chunk_size else dtc))
    dev_name = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu"
    print(f"T={T} Hs={Hs} Ht={Ht} V={V} {a.dtype} on {a.device} ({dev_name}); fused chunks {chunk[0]} (student) / {chunk[1]} (teacher) tokens; "
          f"head gradient {V * Hs * torch.finfo(a.torch_dtype).bits / 8 / GiB:.2f} GiB (not counted)")
    x = _inputs(T, Hs, Ht, V, a.torch_dtype, a.device)
    res, grads = {}, {}
    for m in methods:
        res[m], grads[m] = _measure(m, a, x)
        print(f"{m:14s} peak extra {res[m]['peak_extra_gib']:7.3f} GiB   {res[m]['time_ms']:8.2f} ms   loss {res[m]['loss']:.6g}")
    if "naive" in res:
        for m in res:
            if m not in ("naive", "matmul-floor"):
                res[m]["loss_rel_err_vs_naive"] = abs(res[m]["loss"] - res["naive"]["loss"]) / abs(res["naive"]["loss"])
                res[m]["grad_h_rel_err_vs_naive"] = _rel(grads[m][0], grads["naive"][0])
                res[m]["grad_w_rel_err_vs_naive"] = _rel(grads[m][1], grads["naive"][1])
                print(f"{m:14s} vs naive: loss rel {res[m]['loss_rel_err_vs_naive']:.2e}, grad_h rel-norm "
                      f"{res[m]['grad_h_rel_err_vs_naive']:.2e}, grad_W rel-norm {res[m]['grad_w_rel_err_vs_naive']:.2e}")
    del grads
    sweep = {}
    specs = [t for t in a.sweep.split(",") if t]
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    for _ in range(a.sweep_rounds):
        for spec in specs:  # chunk:teacher_chunk
            a.chunk_size, a.teacher_chunk_size = (int(v) for v in spec.split(":"))
            runs[spec].append(_measure("fused", a, x)[0])
    for spec, rs in runs.items():
        times = sorted(r["time_ms"] for r in rs)
        sweep[spec] = dict(rs[0], time_ms=times[len(times) // 2], time_ms_rounds=[r["time_ms"] for r in rs])
        print(f"fused chunks {spec:>10s}: peak extra {sweep[spec]['peak_extra_gib']:.3f} GiB  {sweep[spec]['time_ms']:.2f} ms "
              f"(median of {len(rs)}: {', '.join(f'{t:.2f}' for t in sweep[spec]['time_ms_rounds'])})")
    a.chunk_size = a.teacher_chunk_size = None
    parts = _breakdown(a, x) if a.breakdown and a.device == "cuda" else None
    prof = _profile_fused(a, x) if a.profile and a.device == "cuda" else None
    kernel = _kernel_sweep(a, V) if a.kernel_sweep and a.device == "cuda" else None
    if "naive" not in res or "fused" not in res:
        print("RESULT needs --methods with fused and naive")
        return
    mem_ratio = res["naive"]["peak_extra_gib"] / res["fused"]["peak_extra_gib"]
    time_ratio = res["fused"]["time_ms"] / res["naive"]["time_ms"]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(tokens=T, hidden=Hs, teacher_hidden=Ht, vocab=V, dtype=a.dtype, device=dev_name,
                           chunks=chunk, iters=a.iters, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                           results=res, chunk_sweep=sweep, kernel_sweep=kernel, profile=prof,
                           breakdown=parts), f, indent=1)
    print(f"RESULT mem_ratio_naive_over_fused={mem_ratio:.2f} time_ratio_fused_over_naive={time_ratio:.3f}")


if __name__ == "__main__":
    main()
