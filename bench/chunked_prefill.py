"""Chunked prefill (`engine.prefill_chunk_tokens`, issue #15 item 2): what a long prompt arriving among decoding
samples costs them, with and without chunks, side by side in one run.

    python bench/chunked_prefill.py --quick     # CPU, a small shape: < 1 min
    python bench/chunked_prefill.py             # GPU: SmolLM2-135M's shape, bf16, 4K-token prompts

`--decoders` samples decode (EOS ignored) while a `--long`-token prompt arrives every `--every` engine steps. Per
chunk setting (none first, then each of --chunks, then none again to show the drift): the longest engine step and
the 99th percentile (what an interrupt may wait, and the gap in every decoder's stream), the decoders' tokens/s,
and the whole run's wall time; the tokens are checked equal across settings (counter-based sampling). Last line:
RESULT max_step_ms_none=.. p99_step_ms_none=.. decode_tok_s_none=.. max_step_ms_c<k>=.. p99_step_ms_c<k>=..
decode_tok_s_c<k>=.. wall_s_..=.. same_tokens=<0|1>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.engine import SHAPES, build  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.engine import Engine  # noqa: E402
from rollout.types import GenerationRequest  # noqa: E402


def run(model, device: str, a, chunk: int | None) -> dict:
    cfg = EngineConfig(max_batch_size=a.decoders + a.arrivals, block_size=16, max_seq_len=a.long + a.new + 16,
                       max_new_tokens=a.new, prefill_chunk_tokens=chunk)
    eng = Engine(model, cfg, eos_id=0, device=device)
    vocab = model.config.vocab_size
    decoders = [GenerationRequest(f"d{i}", tuple(3 + (i * 7 + j) % (vocab - 3) for j in range(16)), a.new, seed=i,
                                  ignore_eos=True) for i in range(a.decoders)]
    longs = [GenerationRequest(f"l{i}", tuple(3 + (i * 13 + j * 5) % (vocab - 3) for j in range(a.long)), 8,
                               seed=100 + i, ignore_eos=True) for i in range(a.arrivals)]
    eng.add(decoders)
    times, out, step, t_run = [], [], 0, time.perf_counter()
    while eng.has_work():
        if step and step % a.every == 0 and longs:
            eng.add([longs.pop(0)])
        t0 = time.perf_counter()
        out += eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        step += 1
    wall = time.perf_counter() - t_run
    dec = sum(len(g.response_tokens) for g in out if g.sample_id.startswith("d"))
    times_ms = sorted(1000 * t for t in times)
    return {"max_step_ms": times_ms[-1], "p99_step_ms": times_ms[int(0.99 * (len(times_ms) - 1))],
            "median_step_ms": statistics.median(times_ms), "decode_tok_s": dec / wall, "wall_s": wall, "steps": step,
            "chunks": eng.stats.prefill_chunks, "tokens": {g.sample_id: g.response_tokens for g in out}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU, a small shape, short prompts: under a minute here")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--long", type=int, default=4096, help="tokens of each arriving prompt")
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--every", type=int, default=24, help="engine steps between arrivals")
    ap.add_argument("--new", type=int, default=128, help="tokens each decoder generates")
    ap.add_argument("--chunks", default="256,1024")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.quick else "cpu"
    if a.quick:
        a.shape, a.decoders, a.long, a.arrivals, a.every, a.new, a.chunks = "tiny", 16, 4096, 3, 20, 96, "256,1024"
        torch.set_num_threads(2)
    model = build(a.shape, device, max_pos=a.long + a.new + 64)
    settings = [None, *(int(c) for c in a.chunks.split(",")), None]
    results, ref = {}, None
    for i, chunk in enumerate(settings):
        name = "none" if chunk is None else f"c{chunk}"
        if chunk is None and i:
            name = "none_again"
        r = run(model, device, a, chunk)
        ref = ref or r["tokens"]
        r["same"] = r["tokens"] == ref
        results[name] = r
        print(f"{name:<11} max step {r['max_step_ms']:8.1f} ms  p99 {r['p99_step_ms']:8.1f} ms  median {r['median_step_ms']:6.1f} ms  "
              f"decoders {r['decode_tok_s']:8.0f} tok/s  wall {r['wall_s']:6.2f} s  steps {r['steps']}  chunks {r['chunks']}  "
              f"same tokens {r['same']}", flush=True)
    keys = {}
    for name, r in results.items():
        if name == "none_again":
            continue
        keys.update({f"max_step_ms_{name}": r["max_step_ms"], f"p99_step_ms_{name}": r["p99_step_ms"],
                     f"decode_tok_s_{name}": r["decode_tok_s"], f"wall_s_{name}": r["wall_s"]})
    keys["same_tokens"] = int(all(r["same"] for r in results.values()))
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in keys.items()))


if __name__ == "__main__":
    main()
