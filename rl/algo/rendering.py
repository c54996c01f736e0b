"""From a task's `Problem` to the policy's prompt tokens, and from a finished `Generation` to a rewarded
`Sample`: the one place where tasks, the tokenizer and effort conditioning meet.

A prompt is rendered once (text as is, chat messages through the tokenizer's chat template), with the
effort prefix of seed §5.1.4 when the sample carries an effort level, and encoded once; from then on
the rollout moves token ids (the trainer trains on the ids the engine produced, never on re-encoded
text). A problem whose prompt is longer than the engine takes is dropped and counted by whoever draws
problems (`draw_fitting`), never sent to the engine. A response's reward is the task's verdict plus, with
effort conditioning, the length penalty r_len = −min(C_max, k(b)·ℓ/L_norm), ℓ counted in tokens of what
the task calls its reasoning (rewards/effort.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from model.tokenizer import Tokenizer
from rewards.effort import EffortConfig, with_effort
from rewards.task import Problem, Task, Trajectory, Verdict
from rewards.task import Turn as TaskTurn
from rl.algo.repercussion import failure_of
from rl.types import Prompt, Sample, Turn
from rollout.tool_calls import render_tools_into_prompt
from rollout.types import Generation


class Rendered(NamedTuple):
    """A prompt as the policy sees it: the text exactly as tokenised, and its ids."""

    text: str
    ids: tuple[int, ...]


RENDER_CACHE_TOKENS = 1 << 21
"""Prompt tokens the Renderer keeps rendered (~75 MB at most as Python ints; a 5,000-row file of 80-token chat prompts
takes 0.4M): an RL job draws a file dataset's prompts once an epoch, and rendering + tokenising is most of what
releasing a group costs the controller (bench/prompt_release.py)."""


class _RenderCache:
    """Rendered prompts by (prompt, effort): the rendering is a function of those alone (the tokenizer and the tool
    declarations are the Renderer's own), so a hit is the same text and ids, whichever problem asks. The oldest
    entries go first past RENDER_CACHE_TOKENS."""

    def __init__(self):
        self.entries: dict[tuple, Rendered] = {}
        self.tokens = 0

    def get(self, key: tuple) -> Rendered | None:
        return self.entries.get(key)

    def put(self, key: tuple, r: Rendered) -> None:
        self.entries[key] = r
        self.tokens += len(r.ids)
        while self.tokens > RENDER_CACHE_TOKENS and len(self.entries) > 1:
            self.tokens -= len(self.entries.pop(next(iter(self.entries))).ids)


def sample_seed(run_seed: int, sample_id: str) -> int:
    """The sampler seed of one sample (counter-based sampling): fixed by the run seed and the sample id,
    so a resumed job, `rl eval` and the in-run evaluation draw the same tokens."""
    digest = hashlib.blake2b(f"{run_seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class Renderer:
    tokenizer: Tokenizer
    tasks: Mapping[str, Task]
    effort: EffortConfig | None = None
    run_seed: int = 0
    max_prompt_tokens: int | None = None
    """Longest prompt the engine takes (`EngineConfig.prompt_limit`); None: no limit is checked here."""
    tools: tuple | None = None
    """Multi-turn tool calls (issue #16): (format, ToolSpecs[, instructions]) declared in every prompt's system
    prompt (rollout/tool_calls.render_tools_into_prompt); None: no tools."""
    tool_datasets: frozenset[str] | None = None
    """The datasets that use the tools (`tools.datasets`); None: every one."""
    _cache: _RenderCache = field(default_factory=_RenderCache, init=False, repr=False, compare=False)

    @classmethod
    def for_recipe(cls, recipe, tasks: Mapping[str, Task], tokenizer: Tokenizer | None = None) -> "Renderer":
        """The renderer a recipe's job uses (its tokenizer unless given, effort, seed, prompt limit and tools)."""
        return cls(tokenizer if tokenizer is not None else recipe.tokenizer.build(), tasks, recipe.effort, recipe.run.seed,
                   recipe.engine.prompt_limit, tools=recipe.tools.declared() if recipe.tools else None,
                   tool_datasets=recipe.tool_datasets())

    def uses_tools(self, dataset: str) -> bool:
        """The dataset's prompts declare the tools and its samples may call them."""
        return self.tools is not None and (self.tool_datasets is None or dataset in self.tool_datasets)

    def prompt_text(self, problem: Problem, effort: int | None = None) -> str:
        """The prompt exactly as tokenised: the effort prefix (seed §5.1.4), then the problem (with the tool
        declarations when its dataset uses tools); chat messages rendered by the tokenizer's chat template."""
        prompt = with_effort(problem.prompt, effort)
        tools = self.uses_tools(problem.dataset)
        if isinstance(prompt, str):
            return render_tools_into_prompt(prompt, *self._tool_args()) if tools else prompt
        messages = [{"role": m.role, "content": m.content} for m in prompt]
        if tools:
            messages = render_tools_into_prompt(messages, *self._tool_args())
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _tool_args(self) -> tuple:
        fmt, specs, *rest = self.tools
        return specs, fmt, (rest[0] if rest else None)

    def render(self, problem: Problem, effort: int | None = None) -> Rendered:
        """The prompt's text (`prompt_text`) and its ids from that one rendering; with `add_bos` the ids start with
        one BOS (a chat template that writes BOS gets no second)."""
        prompt = problem.prompt  # a custom task's messages may come as a list: hashed as the tuple they render as
        key = (prompt if isinstance(prompt, str) else tuple(prompt), effort, self.uses_tools(problem.dataset))
        if (hit := self._cache.get(key)) is not None:
            return hit
        tok = self.tokenizer
        text = self.prompt_text(problem, effort)
        ids = tok.encode(text)
        out = Rendered(text, tuple([tok.bos_id, *ids] if tok.add_bos and ids[:1] != [tok.bos_id] else ids))
        self._cache.put(key, out)
        return out

    def prompt_tokens(self, problem: Problem, effort: int | None = None) -> tuple[int, ...]:
        return self.render(problem, effort).ids

    def fits(self, prompt_tokens: Sequence[int]) -> bool:
        return self.max_prompt_tokens is None or len(prompt_tokens) <= self.max_prompt_tokens

    def draw_fitting(self, stream: Iterator[Problem], efforts: Sequence[int | None] = (None,),
                     max_dropped: int = 1000) -> tuple[Problem, dict[int | None, Rendered], int]:
        """The next problem of `stream` whose prompt fits at every effort level in `efforts`, its rendered prompt
        per level, and how many problems before it were dropped as too long. `max_dropped` in a row is a recipe
        error (one line), not a reason to spin forever."""
        for dropped in range(max_dropped + 1):
            problem = next(stream)
            rendered = {b: self.render(problem, b) for b in dict.fromkeys(efforts)}
            if all(self.fits(r.ids) for r in rendered.values()):
                return problem, rendered, dropped
        longest = max(len(r.ids) for r in rendered.values())
        raise ValueError(f"{max_dropped + 1} prompts in a row of dataset {problem.dataset!r} are longer than "
                         f"engine.max_prompt_tokens={self.max_prompt_tokens} (the last has {longest} tokens)")

    def sample_seed(self, sample_id: str) -> int:
        return sample_seed(self.run_seed, sample_id)

    def trajectory(self, problem: Problem, g: Generation) -> Trajectory:
        """What the verifier sees: one assistant turn, or (tool calls) the assistant's turns and the tools'
        outputs in order; a single-answer verifier reads the last assistant turn."""
        if not g.tool_turns:
            return Trajectory.single(problem, self.tokenizer.decode(g.response_tokens), g.finish_reason)
        turns = [TaskTurn("tool" if t.kind == "tool" else "assistant", t.text) for t in self.turns(g) if t.end > t.start]
        return Trajectory(problem, tuple(turns), g.finish_reason)

    def turns(self, g: Generation) -> tuple[Turn, ...]:
        """A multi-turn response as `Turn`s covering it in order: model turns (decoded) between the tool turns
        the worker recorded (rl/runtime/tool_turns.py); () for a one-turn response."""
        if not g.tool_turns:
            return ()
        out, pos, R = [], 0, len(g.response_tokens)
        for t in g.tool_turns:
            start, end = int(t["start"]), int(t["end"])
            if start > pos:
                out.append(Turn("model", pos, start, self.tokenizer.decode(g.response_tokens[pos:start])))
            if end > start or t.get("failure"):  # a failed call appended nothing: kept, empty, as the sample's end
                out.append(Turn("tool", start, end, str(t.get("output", "")), tool=t.get("tool"), call=t.get("call"),
                                status=t.get("status"), exit_code=t.get("exit_code"), truncated=bool(t.get("truncated")),
                                wall_s=t.get("wall_s")))
            pos = max(pos, end)
        if pos < R:
            out.append(Turn("model", pos, R, self.tokenizer.decode(g.response_tokens[pos:])))
        return tuple(out)

    def reasoning_tokens(self, dataset: str, response: str) -> int:
        """ℓ of the length penalty: tokens of the part of `response` its task counts as reasoning."""
        return len(self.tokenizer.encode(self.tasks[dataset].reasoning(response)))

    def to_sample(self, prompt: Prompt, problem: Problem, g: Generation, verdict: Verdict, *, status: str = "finished",
                  effort: int | None = None, teacher: str | None = None) -> Sample:
        """A rewarded trajectory; with effort, the subgroup is (prompt, effort) and the reward adds the
        effort-dependent length penalty (seed §5.1.4)."""
        text = self.tokenizer.decode(g.response_tokens)
        reward = verdict.reward
        if effort is not None:
            reward += self.effort.length_penalty(effort, self.reasoning_tokens(prompt.dataset, text))
        return Sample(
            sample_id=g.sample_id, prompt_id=prompt.prompt_id, dataset=prompt.dataset,
            group_id=prompt.prompt_id if effort is None else f"{prompt.prompt_id}@{effort}",
            prompt_tokens=g.prompt_tokens, response_tokens=g.response_tokens,
            prompt_text=prompt.text if effort is None else self.render(problem, effort).text, response_text=text, behavior_logprobs_T=g.logprobs,
            policy_versions_T=g.policy_versions, reward=reward, correct=verdict.correct,
            finish_reason=g.finish_reason, status=status, routing_trace=g.routing_trace,
            timings={"finished_at": time.time(), "generate_s": g.generate_s},
            teacher=teacher, config_version=prompt.config_version, effort=effort, reason=verdict.reason,
            turns=self.turns(g), failure=failure_of(g.tool_turns),
        )
