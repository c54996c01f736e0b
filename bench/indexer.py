"""CSA2 indexer cost per decode query: flat vs Hierarchical Sparse Indexer (seed §2.3.2; issue #5).

    python bench/indexer.py [--quick] [--device cuda] [--eager] [--no-pool-kernel] [--json out.json]

For each context length C, a batch of decode queries (one per sequence, at position C-1) runs the
indexer of a Full layer and of a Reindex layer (`CSA2Attention.index`: indexer Q/w projection, scores
Σ_h w_h·relu(q_h·k), top-k; the hierarchical Full layer also builds the candidate pool) against
C/m compressed entries of random indexer K. Reported per query: positions scored (the width of the
score tensor the layer actually computed) and indexer time, flat vs hierarchical. The expectation
(seed §2.3.2): a Reindex layer's scored count stops growing with C once the pool is full, while the
first Full layer still scans everything and pays a little extra for the block selection.
PyTorch reference code, top-k by a stable sort, except that on CUDA a hierarchical Reindex layer scores
its pool with the fused Triton kernel of model/kernels/indexer.py (one read of each pool row of indexer
K; the flat indexer's dense einsum has no per-query gather to fuse away); --no-pool-kernel times the
PyTorch pool path instead (an index_select of the pool rows, then the same einsums as the flat path).
On CUDA each call is timed as a CUDA-graph replay (GPU time; --eager times Python dispatch too).
On CPU it runs single-threaded (shared cores time erratically with more); --quick takes a few seconds.
Last line: RESULT scored_flat=<Reindex, flat> scored_hier=<Reindex, hierarchical> scored_full=..
reindex_time_flat_over_hier=.. full_time_hier_over_flat=.. context=.. (at the largest context run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from model import sparse_attention
from model.config import ModelConfig, SparseAttentionConfig
from model.sparse_attention import CSA2Attention, SharedState


def _time(fn, iters: int, device: str, repeats: int = 5) -> float:
    """Seconds per call: the fastest of `repeats` timed blocks of `iters` back-to-back calls (shared
    machines: the minimum is the least disturbed block)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    blocks = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        blocks.append((time.perf_counter() - t0) / iters)
    return min(blocks)


def _graphed(fn):
    """Capture fn in a CUDA graph and return its replay: the timing is then the GPU's, not the Python
    dispatch of this reference's ~50 small kernels (which bounds eager decode-sized calls at ~1 ms)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized: small dims, contexts 2K-32K")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default=None, help="comma list of token counts (default 4K..128K, quick 2K..32K)")
    ap.add_argument("--compress-ratio", type=int, default=4)
    ap.add_argument("--topk", type=int, default=None, help="default 512 (quick 64)")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=None, help="default 512 (quick 64): pool = 8 x topk, as seed §2.3.2's 2048x8 vs top-2048")
    ap.add_argument("--index-heads", type=int, default=None, help="default 64 (quick 16)")
    ap.add_argument("--index-dim", type=int, default=None, help="default 128 (quick 64)")
    ap.add_argument("--hidden", type=int, default=None, help="default 2048 (quick 256)")
    ap.add_argument("--queries", type=int, default=None, help="decode queries per call, default 64 (quick 4)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timed block, fastest of 5 blocks; default 20 (quick 10)")
    ap.add_argument("--eager", action="store_true", help="on CUDA, time eager calls instead of CUDA-graph replays")
    ap.add_argument("--no-pool-kernel", action="store_true", help="score hierarchical pools with the PyTorch path")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    a = ap.parse_args()
    q = a.quick
    sparse_attention.POOL_KERNEL = not a.no_pool_kernel
    pick = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    topk, num_blocks = pick(a.topk, 512, 64), pick(a.num_blocks, 512, 64)
    heads, dim, hidden = pick(a.index_heads, 64, 16), pick(a.index_dim, 128, 64), pick(a.hidden, 2048, 256)
    B, iters = pick(a.queries, 64, 4), pick(a.iters, 20, 10)
    contexts = [int(c) for c in a.contexts.split(",")] if a.contexts else (
        [2048, 4096, 8192, 16384, 32768] if q else [4096, 8192, 16384, 32768, 65536, 131072])
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    if a.device == "cpu":
        torch.set_num_threads(1)  # the CPU hosts share their cores: one thread times steadily, several spin
    m = a.compress_ratio

    mc = ModelConfig(hidden_size=hidden, num_heads=4, num_kv_heads=1, head_dim=64)
    base = dict(compress_ratio=m, topk=topk, index_heads=heads, index_dim=dim, layer_modes=("full", "reindex"))
    flat_cfg = SparseAttentionConfig(**base)
    hier_cfg = SparseAttentionConfig(**base, hierarchical=dict(from_layer=0, block_size=a.block_size, num_blocks=num_blocks))
    torch.manual_seed(0)
    layers = {}
    for name, cfg in (("flat", flat_cfg), ("hier", hier_cfg)):
        layers[name] = [CSA2Attention(mc, cfg, i).to(a.device, dtype).eval() for i in (0, 1)]
    for i in (0, 1):  # same indexer weights in both variants
        layers["hier"][i].load_state_dict(layers["flat"][i].state_dict())
    pool = num_blocks * a.block_size
    graphs = a.device.startswith("cuda") and not a.eager
    dev_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {dev_name}, {dtype}; m={m} topk={topk} pool={num_blocks}x{a.block_size}={pool} "
          f"index_heads={heads} index_dim={dim} hidden={hidden}; {B} decode queries per call, {iters} iters, "
          f"{'CUDA-graph replays' if graphs else 'eager calls'}; pool kernel "
          f"{'on' if sparse_attention.POOL_KERNEL and a.device.startswith('cuda') else 'off'}")
    print(f"{'context':>8} {'entries':>8} | {'scored/query: Full flat':>23} {'hier':>7} {'Reindex flat':>12} {'hier':>6} | "
          f"{'us/query: Full flat':>19} {'hier':>8} {'Reindex flat':>12} {'hier':>8} | {'Reindex flat/hier':>17}")
    rows = []
    with torch.no_grad():
        for C in contexts:
            N = C // m
            x = torch.randn(B, 1, hidden, device=a.device, dtype=dtype)
            pos = torch.tensor([C - 1], device=a.device)
            index_k = torch.randn(B, N, dim, device=a.device, dtype=dtype)
            row = dict(context=C, entries=N)
            for name in ("flat", "hier"):
                full, reindex = layers[name]
                shared = SharedState(index_k=index_k)

                def run_full():
                    shared.candidate_pool = None
                    return full.index(x, shared, pos)

                def run_reindex():
                    return reindex.index(x, shared, pos)

                if graphs:
                    try:
                        t_full = _time(_graphed(run_full), iters, a.device)
                        run_full()  # this variant's candidate pool (hier), kept in `shared` for the Reindex layer
                        t_reindex = _time(_graphed(run_reindex), iters, a.device)
                    except RuntimeError as e:  # capture is an optimisation of the measurement, not its subject
                        print(f"CUDA graph capture failed ({e}); timing eager calls from here on")
                        graphs = False
                if not graphs:
                    t_full = _time(run_full, iters, a.device)
                    run_full()  # leaves this variant's candidate pool (hier) in `shared` for the Reindex layer
                    t_reindex = _time(run_reindex, iters, a.device)
                if name == "hier" and sparse_attention.POOL_KERNEL and a.device.startswith("cuda"):
                    sel = run_reindex()[0]  # the kernel's picks vs the PyTorch pool path's, same pool
                    sparse_attention.POOL_KERNEL = False
                    ref = run_reindex()[0]
                    sparse_attention.POOL_KERNEL = True
                    same = (sel.ids.sort(-1).values == ref.ids.sort(-1).values).all(-1)
                    row["pool_kernel_same_picks"] = f"{int(same.sum())}/{same.numel()}"
                row[f"scored_full_{name}"] = shared.scored[0]
                row[f"scored_reindex_{name}"] = shared.scored[1]
                row[f"us_full_{name}"] = t_full / B * 1e6
                row[f"us_reindex_{name}"] = t_reindex / B * 1e6
            row["reindex_time_flat_over_hier"] = row["us_reindex_flat"] / row["us_reindex_hier"]
            row["full_time_hier_over_flat"] = row["us_full_hier"] / row["us_full_flat"]
            rows.append(row)
            print(f"{C:>8} {N:>8} | {row['scored_full_flat']:>23} {row['scored_full_hier']:>7} "
                  f"{row['scored_reindex_flat']:>12} {row['scored_reindex_hier']:>6} | {row['us_full_flat']:>19.2f} "
                  f"{row['us_full_hier']:>8.2f} {row['us_reindex_flat']:>12.2f} {row['us_reindex_hier']:>8.2f} | "
                  f"{row['reindex_time_flat_over_hier']:>17.2f}"
                  + (f"  (kernel picks == PyTorch picks: {row['pool_kernel_same_picks']} queries)"
                     if "pool_kernel_same_picks" in row else ""))
    if a.json:
        a.json.write_text(json.dumps(dict(device=dev_name, dtype=str(dtype), compress_ratio=m, topk=topk,
                                          block_size=a.block_size, num_blocks=num_blocks, index_heads=heads,
                                          index_dim=dim, hidden=hidden, queries=B, cuda_graphs=graphs,
                                          pool_kernel=sparse_attention.POOL_KERNEL and a.device.startswith("cuda"),
                                          rows=rows), indent=2))
    r = rows[-1]
    print(f"RESULT scored_flat={r['scored_reindex_flat']} scored_hier={r['scored_reindex_hier']} "
          f"scored_full={r['scored_full_flat']} reindex_time_flat_over_hier={r['reindex_time_flat_over_hier']:.2f} "
          f"full_time_hier_over_flat={r['full_time_hier_over_flat']:.2f} context={r['context']}")


if __name__ == "__main__":
    main()
