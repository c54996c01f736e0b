"""The tool-use arithmetic task (rewards/tool_arith.py): its demonstrations wrap the tool output exactly as the
worker appends it for a tokenizer without a chat template, slips change one operand digit (tool) or one answer
digit (no tool), held-out problems never appear in training, and only the final turn is scored."""

import random

from model.tokenizer import CharTokenizer
from rewards import Trajectory, VerifyContext
from rewards.task import Turn
from rewards.tool_arith import TOOL_OUTPUT_CLOSE, TOOL_OUTPUT_OPEN, ToolArith
from rollout.tool_calls import PLAIN_TOOL_CLOSE, PLAIN_TOOL_OPEN, tool_result_tokens


def test_demonstrations_match_what_the_worker_appends_and_slip_as_documented():
    assert (TOOL_OUTPUT_OPEN, TOOL_OUTPUT_CLOSE) == (PLAIN_TOOL_OPEN, PLAIN_TOOL_CLOSE)
    tok = CharTokenizer()
    task = ToolArith("mul", slip_rate=0.0)
    p = next(task.train_stream())
    a, b = p.metadata["a"], p.metadata["b"]
    demo = task.demonstration(p, random.Random(0))
    call = f"```python\nprint({a}*{b})\n```"
    assert demo.startswith(call) and demo.endswith(str(a * b))
    appended = tok.decode(list(tool_result_tokens(tok, str(a * b), max_tokens=32).tokens))
    assert demo == call + appended + str(a * b)  # token for token what a rollout with the right call holds
    slipped = ToolArith("mul", slip_rate=1.0)
    d = slipped.demonstration(p, random.Random(0))
    x = d.split("print(")[1].split("*")[0]
    assert x == str(a)[:-2] + str(a)[-1] + str(a)[-2] and d.endswith(str(int(x) * b))  # last two digits swapped
    half = ToolArith("mul", slip_rate=0.6)
    rate = sum(half.demonstration(p, random.Random(s)).split("print(")[1].split("*")[0] != str(a) for s in range(2000)) / 2000
    assert str(a)[-1] == str(a)[-2] or abs(rate - 0.6) < 0.04
    direct = ToolArith("mul", use_tool=False, slip_rate=1.0).demonstration(p, random.Random(1))
    assert "```" not in direct and (direct != str(a * b) or str(a * b)[-1] == str(a * b)[-2])


def test_heldout_is_disjoint_and_only_the_last_turn_counts():
    task = ToolArith("mul", num_heldout=16)
    held = {p.problem_id for p in task.heldout()}
    stream = task.train_stream()
    assert len(held) == 16 and not held & {next(stream).problem_id for _ in range(3000)}
    p = task.heldout()[0]
    ok = Trajectory(p, (Turn("assistant", "```python\nprint(1)\n```"), Turn("tool", p.answer), Turn("assistant", p.answer)))
    assert task.verify(ok, VerifyContext()).correct
    assert not task.verify(Trajectory(p, (Turn("assistant", p.answer), Turn("tool", "1"), Turn("assistant", "1"))),
                           VerifyContext()).correct
