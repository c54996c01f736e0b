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
