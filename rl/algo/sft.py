"""SFT batches: the one source of demonstrations for the driver's SFT stages and the teacher trainer.

Problems are drawn round-robin from each task's train stream; each prompt is rendered as the policy will
see it (with the effort prefix on a share `effort_prefix_frac` of them, at a random training level,
seed §5.1.4), the target is the task's demonstration plus EOS, shortened at effort level b for the
effort cold start (`cold_start`). A batch is a `TrainBatch` normalised by its own response tokens; the
driver deals it to the workers by length (rl/train/parallel.py `deal_by_length`) and the trainer's SFT objective does the rest.
The stream's position (problems drawn, the demonstration RNG) is checkpointed and restored exactly.

A multi-turn demonstration (tool use: the task returns `rewards.task.Turn`s) is tokenised as a rollout would hold it:
each assistant turn's text on its own (loss 1), each tool output as the worker appends it after a call
(rollout/tool_calls.py `tool_result_tokens`: the end of the assistant's turn, the tool message in the chat template's
wrapping, the next assistant header, cut at the recipe's `tools.max_tool_output_tokens`; loss 0), then EOS. So the
warm start teaches the calls and the answers, not the outputs, in the very tokens the engine will append.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from model.tokenizer import Tokenizer
from rewards.task import Task, Turn
from rl.config import SFTStage
from rl.algo.rendering import Renderer
from rl.algo.streams import Cursor
from rl.train.trainer import TrainBatch
from rollout.tool_calls import tool_result_tokens


def cold_start(stage: SFTStage, effort: int | None) -> dict:
    """Demonstration options at effort level b for the effort cold start (seed §5.1.4, App. C)."""
    if not stage.effort_cold_start or effort is None:
        return {}
    if stage.cold_start_style == "partial":
        return {"reasoning_frac": effort / 100}
    return {"direct_answer_rate": 1 - effort / 100}


def demonstration_tokens(tokenizer: Tokenizer, demo: str | tuple[Turn, ...], tool_output_tokens: int | None
                         ) -> tuple[list[int], list[int] | None]:
    """A demonstration's response ids and its loss mask (None: every token trained): text as is plus EOS, or turns
    with each tool output tokenised as the worker appends it (loss 0; module docstring)."""
    if isinstance(demo, str):
        return tokenizer.encode(demo, eos=True), None
    ids: list[int] = []
    mask: list[int] = []
    for turn in demo:
        if turn.role == "tool":
            if tool_output_tokens is None:
                raise ValueError("a demonstration with tool turns needs the recipe's `tools` (tools.max_tool_output_tokens)")
            part, trained = list(tool_result_tokens(tokenizer, turn.text, max_tokens=tool_output_tokens).tokens), 0
        else:
            part, trained = tokenizer.encode(turn.text), 1
        ids += part
        mask += [trained] * len(part)
    return ids + [tokenizer.eos_id], mask + [1]


class DemonstrationStream:
    def __init__(self, tasks: Mapping[str, Task], renderer: Renderer, stage: SFTStage, *, seed_offset: int, rng_seed: str,
                 tool_output_tokens: int | None = None):
        self.tasks, self.renderer, self.stage = tasks, renderer, stage
        self.tool_output_tokens = tool_output_tokens
        """The recipe's `tools.max_tool_output_tokens` (multi-turn demonstrations); None: a recipe without tools."""
        self.cursors = [Cursor(t, seed_offset=seed_offset) for t in tasks.values()]
        self.rng = random.Random(rng_seed)
        self.drawn = 0
        self.levels = renderer.effort.levels if renderer.effort is not None else None

    def next_problem(self):
        self.drawn += 1
        return next(self.cursors[(self.drawn - 1) % len(self.cursors)])

    def next_batch(self, batch_size: int) -> TrainBatch:
        problems = [self.next_problem() for _ in range(batch_size)]
        rng, stage = self.rng, self.stage
        efforts = [rng.choice(self.levels) if self.levels and rng.random() < stage.effort_prefix_frac else None
                   for _ in problems]
        prompts = [self.renderer.prompt_tokens(p, b) for p, b in zip(problems, efforts)]
        rows = [demonstration_tokens(self.renderer.tokenizer,
                                     self.tasks[p.dataset].demonstration(p, rng, **cold_start(stage, b)),
                                     self.tool_output_tokens) for p, b in zip(problems, efforts)]
        responses = [ids for ids, _ in rows]
        if all(mask is None for _, mask in rows):
            return TrainBatch(prompts, responses, float(sum(len(r) for r in responses)))
        masks = [mask if mask is not None else [1] * len(ids) for ids, mask in rows]
        return TrainBatch(prompts, responses, float(sum(map(sum, masks))), loss_masks_B=masks)

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved stream was (the task streams are deterministic per seed)."""
        self.drawn = state["drawn"]
        self.rng.setstate(state["rng"])
        n = len(self.cursors)
        for i, c in enumerate(self.cursors):  # round-robin: cursor i has drawn ceil((drawn - i) / n)
            c.skip_to(max(0, -(-(self.drawn - i) // n)))
