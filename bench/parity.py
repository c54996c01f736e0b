"""asyncrl vs transformers on a real model: SmolLM2-135M-Instruct from its GGUF file (issue #14 evidence).

    python bench/parity.py --quick [--gguf PATH] [--json out.json]

First, the four architectures as tiny random models saved by transformers (Llama with Llama 3.1 RoPE
scaling, Qwen2 with q/k/v bias, Qwen3, Qwen3-MoE): the same three checks, 16 greedy tokens. Then SmolLM2.
Both load the same GGUF file (Q4_1 weights, Q8_0 embedding, F32 norms), each dequantising it itself, on
CPU in float32. Measured over all positions of 8 chat prompts rendered with the GGUF's chat template:
max |Δlogit| and the mean (per position) KL(transformers || asyncrl); greedy generation of 32 tokens per
prompt (asyncrl through its Engine, transformers through generate), counted prompts identical token for
token; then asyncrl's export of the loaded model to a Hugging Face directory, loaded back by transformers:
max |Δlogit| against asyncrl on the same prompts. --quick is that (no network, under a minute here); without
it, 64 greedy tokens. The file comes from --gguf, $ASYNCRL_SMOLLM2_GGUF, or where
`rl models fetch smollm2-135m-instruct` puts it; missing, the script fails with one line (it never
falls back to another model).

Last line: RESULT model=SmolLM2-135M-Instruct max_abs_logit_diff=.. mean_kl=.. greedy_match=../.. export_max_abs_logit_diff=..
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.hf_tiny import FETCH_HINT, engine_greedy, hf_greedy, logit_gap, make_hf, smollm2_gguf, smollm2_parity  # noqa: E402

KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe")


def tiny_table(tmp: Path) -> list[dict]:
    """The four architectures as tiny random models built and saved by transformers (tests/hf_tiny.py):
    logits at every position of 8 prompts, 16 greedy tokens each, and the export round trip."""
    import torch
    from transformers import AutoModelForCausalLM

    from model.pretrained import build_decoder, export_hf, read_pretrained_config

    prompts = [[1] + [(7 * i + 13 * j) % 150 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    rows = []
    for seed, kind in enumerate(KINDS):
        hf = make_hf(kind, tmp / kind, seed=seed)
        ours = build_decoder(read_pretrained_config(tmp / kind)).eval()
        back = AutoModelForCausalLM.from_pretrained(export_hf(ours, tmp / f"{kind}-export"), dtype=torch.float32).eval()
        with torch.no_grad():
            pairs = [(ours(torch.tensor([p]))[0], hf(torch.tensor([p])).logits, back(torch.tensor([p])).logits) for p in prompts]
        gaps = [logit_gap(a, b) for a, b, _ in pairs]
        greedy = sum(a == b for a, b in zip(engine_greedy(ours, prompts, 16), hf_greedy(hf, prompts, 16)))
        rows.append({"model": kind, "max_abs_logit_diff": max(g[0] for g in gaps), "mean_kl": sum(g[1] for g in gaps) / len(gaps),
                     "greedy_match": f"{greedy}/{len(prompts)}",
                     "export_max_abs_logit_diff": max((a - c).abs().max().item() for a, _, c in pairs)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 greedy tokens per prompt (default 64)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF file (default: $ASYNCRL_SMOLLM2_GGUF or the fetched file)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine two OpenMP threads spin against other "
                         "processes and run 5x slower)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    if a.gguf:
        os.environ["ASYNCRL_SMOLLM2_GGUF"] = a.gguf
    path = smollm2_gguf()
    if path is None:
        print(f"parity: SmolLM2 GGUF file not found: run `{FETCH_HINT}` (or pass --gguf / set ASYNCRL_SMOLLM2_GGUF)",
              file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = tiny_table(Path(tmp))
        print(f"{'tiny random model':<18} {'max |Δlogit|':>12} {'mean KL':>10} {'greedy':>7} {'export |Δ|':>11}")
        for row in rows:
            print(f"{row['model']:<18} {row['max_abs_logit_diff']:>12.3g} {row['mean_kl']:>10.3g} {row['greedy_match']:>7} "
                  f"{row['export_max_abs_logit_diff']:>11.3g}")
        r = smollm2_parity(path, new_tokens=32 if a.quick else 64, export_dir=Path(tmp) / "export")
    wall = time.perf_counter() - t0
    cpu = time.process_time()
    print(f"model file          {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    print(f"positions compared  {r['positions']} (8 chat prompts)")
    print(f"max |Δlogit|        {r['max_abs_logit_diff']:.3g}")
    print(f"mean KL             {r['mean_kl']:.3g}")
    print(f"greedy identical    {r['greedy_match']}/{r['greedy_total']} prompts ({32 if a.quick else 64} tokens each)")
    print(f"export round trip   max |Δlogit| {r['export_max_abs_logit_diff']:.3g}, transformers loading report "
          f"{r['export_loading_info'] or 'clean (no missing, unexpected or mismatched keys)'}")
    print(f"first reply         {r['first_reply'][:70]!r}")
    print(f"seconds             {r['seconds']}; total wall {wall:.1f} s, process CPU {cpu:.1f} s")
    if a.json:
        keep = {k: v for k, v in r.items() if k not in ("ours_gen", "theirs_gen")}
        Path(a.json).write_text(json.dumps(keep | {"wall_s": wall, "tiny": rows}, indent=2))
    print(f"RESULT model=SmolLM2-135M-Instruct max_abs_logit_diff={r['max_abs_logit_diff']:.3g} mean_kl={r['mean_kl']:.3g} "
          f"greedy_match={r['greedy_match']}/{r['greedy_total']} export_max_abs_logit_diff={r['export_max_abs_logit_diff']:.3g}")
    return 0 if not r["export_loading_info"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
