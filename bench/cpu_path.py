"""The engine's CPU path (issue #15: "the CPU path does not get slower"): tokens/s of the quickstart recipe's model
and engine settings (configs/quickstart.yaml: the 4-layer MoE, random weights) generating 256 samples of 96 tokens
from 24-token prompts, EOS ignored, 2 threads. Imports the asyncrl tree given by --tree (default: this one), so that
an older commit's tree (`git worktree add /tmp/old <commit>`) can be timed by the same script, in turn:

    for i in $(seq 12); do python bench/cpu_path.py --tree /tmp/old; python bench/cpu_path.py; done

Last line: RESULT tree=.. samples=.. tokens=.. seconds=.. tok_s=..
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="64 samples")
    a = ap.parse_args()
    sys.path.insert(0, a.tree)
    import torch

    from model.decoder import Decoder
    from rl.recipe_io import load_recipe
    from rollout.engine import Engine
    from rollout.types import GenerationRequest

    torch.set_num_threads(2)
    torch.manual_seed(0)
    recipe = load_recipe(f"{a.tree}/configs/quickstart.yaml")
    model = Decoder(recipe.model).eval()
    g = torch.Generator().manual_seed(0)
    n, new = (64 if a.quick else a.samples), 96
    reqs = [GenerationRequest(f"r{i}", tuple(torch.randint(3, recipe.model.vocab_size, (24,), generator=g).tolist()), new,
                              seed=i, temperature=1.0, ignore_eos=True) for i in range(n)]
    warm = Engine(model, recipe.engine, eos_id=2, device="cpu")
    warm.add(reqs[:4])
    while warm.has_work():
        warm.step()
    eng = Engine(model, recipe.engine, eos_id=2, device="cpu")
    t0 = time.perf_counter()
    eng.add(reqs)
    done = []
    while eng.has_work():
        done += eng.step()
    dt = time.perf_counter() - t0
    tokens = sum(len(x.response_tokens) for x in done)
    print(f"RESULT tree={a.tree} samples={len(done)} tokens={tokens} seconds={dt:.3f} tok_s={tokens / dt:.1f}")


if __name__ == "__main__":
    main()
