"""A multi-turn Generation becomes a verifier's Trajectory (assistant and tool turns, the last assistant turn as
the answer) and a stored Sample whose turns cover the response, tool tokens with loss mask 0; prompts of a recipe
with tools declare them."""

from model.tokenizer import CharTokenizer
from rewards.task import Message, Problem
from rl.algo.rendering import Renderer
from rl.types import Prompt
from rewards.task import Verdict
from rollout.tool_calls import PYTHON_TOOL
from rollout.types import Generation


def test_a_multi_turn_generation_renders_turn_by_turn():
    tok = CharTokenizer()
    r = Renderer(tok, {}, tools=("code", (PYTHON_TOOL,)))
    call, out, answer = "```python\nprint(6*7)\n```", "\n<tool_output>\n42\n</tool_output>\n", "It is 42."
    resp = tok.encode(call) + tok.encode(out) + tok.encode(answer)
    s, e = len(tok.encode(call)), len(tok.encode(call)) + len(tok.encode(out))
    g = Generation("x-0", (1, 5), tuple(resp), (0.0,) * len(resp), (0,) * len(resp), "eos", None,
                   appended_spans=((s, e),),
                   tool_turns=({"start": s, "end": e, "tool": "python", "call": "print(6*7)", "status": "ok",
                                "exit_code": 0, "output": "42", "truncated": False, "wall_s": 0.1},))
    problem = Problem("p", "d", "What is 6*7?", "42")
    traj = r.trajectory(problem, g)
    assert [t.role for t in traj.turns] == ["assistant", "tool", "assistant"]
    assert traj.turns[0].text == call and traj.turns[1].text == "42" and traj.response == answer
    sample = r.to_sample(Prompt("p", "d", "", (1, 5), "42", 1, 0), problem, g, Verdict(1.0, True))
    assert [(t.kind, t.start, t.end) for t in sample.turns] == [("model", 0, s), ("tool", s, e), ("model", e, len(resp))]
    assert sample.loss_mask_T() == tuple([1] * s + [0] * (e - s) + [1] * (len(resp) - e))
    assert sample.turns[1].status == "ok" and sample.turns[1].exit_code == 0
    # the prompt declares the tool; a renderer without tools leaves it as it was
    assert "```python" in r.prompt_text(problem) and Renderer(tok, {}).prompt_text(problem) == "What is 6*7?"
    chat = Problem("q", "d", (Message("user", "hi"),), "x")
    assert "```python" in Renderer(tok, {}, tools=("code", (PYTHON_TOOL,))).prompt_text(chat)


def test_the_recipe_can_word_the_tool_declaration_itself():
    tok = CharTokenizer()
    problem = Problem("p", "d", "What is 6*7?", "42")
    r = Renderer(tok, {}, tools=("code", (PYTHON_TOOL,), "Use python."))
    assert r.prompt_text(problem) == "Use python.\n\nWhat is 6*7?"


def test_tools_can_be_limited_to_some_datasets_in_prompts_and_requests():
    """`tools.datasets`: a multi-domain run where one domain calls tools (issue #43's OPD student): the other
    datasets' prompts render as their own runs rendered them and their samples never stop at a call."""
    import pytest

    from rewards.compute import ComputeTask
    from rewards.extract import ExtractTask
    from rl.algo.evaluation import evaluate
    from rl.config import Recipe

    recipe = Recipe.model_validate({
        "datasets": [{"type": "custom", "name": "calc", "task": "rewards.compute:ComputeTask", "args": {"num_heldout": 2}},
                     {"type": "custom", "name": "json", "task": "rewards.extract:ExtractTask", "args": {"num_heldout": 2}}],
        "tools": {"format": "code", "instructions": "Use python.", "datasets": ["calc"]},
        "stages": [{"type": "sft", "max_steps": 1}]})
    tasks = {"calc": ComputeTask("calc", num_heldout=2), "json": ExtractTask("json", num_heldout=2)}
    tok = CharTokenizer()
    r = Renderer(tok, tasks, tools=recipe.tools.declared(), tool_datasets=recipe.tool_datasets())
    calc, json_ = tasks["calc"].heldout()[0], tasks["json"].heldout()[0]
    assert "Use python." in r.prompt_text(calc) and "Use python." not in r.prompt_text(json_)
    assert r.prompt_text(json_) == Renderer(tok, tasks).prompt_text(json_)
    same = json_.__class__(json_.problem_id, "calc", json_.prompt, json_.answer, json_.metadata)  # one prompt, two datasets
    assert r.render(json_).ids != r.render(same).ids  # the render cache keys on the dataset's tool use too
    seen = []

    def generate(reqs):
        seen.extend(reqs)
        return [Generation(q.sample_id, q.prompt_tokens, (tok.eos_id,), (0.0,), (0,), "eos", None) for q in reqs]

    evaluate(generate, r, tasks, max_new_tokens=8)
    assert {q.sample_id.split(":")[0].removeprefix("eval-"): q.tool_calls for q in seen} == {"calc": True, "json": False}
    with pytest.raises(ValueError, match=r"tools.datasets names unknown datasets \['csv'\]"):
        Recipe.model_validate({**recipe.model_dump(mode="json", exclude_unset=True),
                               "tools": {"format": "code", "datasets": ["csv"]}})
