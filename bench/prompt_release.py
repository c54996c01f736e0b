"""The controller's host work to release one GRPO group of the SmolLM2 recipe (`AsyncGRPO.release`): draw the problem,
render the chat template, tokenise, build the Prompt and one GenerationRequest per sample (issue #15: the controller's
per-sample cost; run R's "new prompts" were 20 s of its 177 s of rollout, BENCHMARKS.md).

    python bench/prompt_release.py [--quick] [--recipe configs/smollm2_grpo.yaml] [--groups 2000]

Needs the recipe's tokenizer (`rl models fetch smollm2-135m-instruct`). Arms, in turn, median of --rounds, each on
--groups problems drawn from the dataset's stream: `first_epoch` (a fresh Renderer: every prompt rendered and
tokenised once), `render_twice` (the same, plus the chat template rendered again for the prompt's text, as the
controller did before it took the text from the same rendering), `later_epochs` (a Renderer that has rendered these
problems before: its cache of rendered prompts, `rl.algo.rendering.RENDER_CACHE_TOKENS`, answers); then a first epoch's
release split into rendering, encoding and the rest.
Last line: RESULT first_epoch_us_per_group=.. render_twice_us_per_group=.. later_epochs_us_per_group=..
render_once_speedup=.. cache_speedup=.. render_us=.. encode_us=.. rest_us=..
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.recipe_io import load_recipe  # noqa: E402
from rl.algo.rendering import Renderer  # noqa: E402
from rl.algo.streams import Cursor  # noqa: E402
from rl.types import Prompt  # noqa: E402
from rollout.types import GenerationRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer groups and rounds (seconds)")
    ap.add_argument("--recipe", default="configs/smollm2_grpo.yaml")
    ap.add_argument("--groups", type=int, default=2000, help="groups released per arm and round")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    groups, rounds = (300, 3) if a.quick else (a.groups, a.rounds)
    recipe = load_recipe(a.recipe, ["run.device=cpu"])
    tasks = {d.name: d.build() for d in recipe.datasets}
    stage = recipe.stages[-1]
    G = getattr(stage, "group_size", 8)
    sampling = recipe.engine.sampling
    d, task = next(iter(tasks.items()))
    cursor = Cursor(task, seed_offset=2000)
    problems = [next(cursor) for _ in range(groups)]

    def renderer() -> Renderer:
        return Renderer.for_recipe(recipe, tasks)

    def release(r: Renderer, twice: bool) -> None:
        stream = iter(problems)
        for i in range(groups):
            problem, rendered, _ = r.draw_fitting(stream, [None] * G)
            plain = rendered[None]
            Prompt(f"p{i}", d, r.prompt_text(problem) if twice else plain.text, plain.ids, problem.answer, G, 0, 0)
            for j in range(G):
                sid = f"p{i}-{j}"
                GenerationRequest(sid, plain.ids, recipe.max_response_tokens, seed=r.sample_seed(sid),
                                  temperature=sampling.temperature, top_p=sampling.top_p)

    seen = renderer()
    release(seen, False)  # warms the template and the tokenizer, and fills `seen`'s cache
    us: dict[str, list[float]] = {"first_epoch": [], "render_twice": [], "later_epochs": []}
    for _ in range(rounds):
        for arm in us:
            r = seen if arm == "later_epochs" else renderer()
            t0 = time.perf_counter()
            release(r, arm == "render_twice")
            us[arm].append((time.perf_counter() - t0) / groups * 1e6)
    med = {arm: statistics.median(v) for arm, v in us.items()}
    r = renderer()
    t0 = time.perf_counter()
    texts = [r.prompt_text(p) for p in problems]
    render = (time.perf_counter() - t0) / groups * 1e6
    t0 = time.perf_counter()
    for t in texts:
        r.tokenizer.encode(t)
    encode = (time.perf_counter() - t0) / groups * 1e6
    rest = med["first_epoch"] - render - encode
    print(f"{recipe.run.name}: a group of {G}, median of {rounds} x {groups} groups: first epoch {med['first_epoch']:.1f} "
          f"us, with the second rendering {med['render_twice']:.1f} us, later epochs {med['later_epochs']:.1f} us; of a "
          f"first epoch's release: rendering {render:.1f} us, encoding {encode:.1f} us, the rest (draw, Prompt, {G} "
          f"requests and seeds) {rest:.1f} us")
    print(f"RESULT first_epoch_us_per_group={med['first_epoch']:.1f} render_twice_us_per_group={med['render_twice']:.1f} "
          f"later_epochs_us_per_group={med['later_epochs']:.1f} "
          f"render_once_speedup={med['render_twice'] / med['first_epoch']:.2f} "
          f"cache_speedup={med['first_epoch'] / med['later_epochs']:.2f} render_us={render:.1f} encode_us={encode:.1f} "
          f"rest_us={rest:.1f}")

if __name__ == "__main__":
    main()
