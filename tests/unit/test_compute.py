"""The computation domain (rewards/compute.py, issue #43 domain b): every demonstration's code prints its answer,
the verifier reads the answer line as stated, and a multi-turn demonstration trains the call and the answer but not
the tool's output, which it holds in the tokens the worker appends (rl/algo/sft.py)."""

from __future__ import annotations

import contextlib
import io
import random
from itertools import islice

import pytest

from model.tokenizer import CharTokenizer
from rewards.compute import KINDS, ComputeTask, read_answer
from rewards.task import Trajectory, Turn, VerifyContext
from rl.algo.rendering import Renderer
from rl.algo.sft import DemonstrationStream, demonstration_tokens
from rl.config import SFTStage
from rollout.tool_calls import PLAIN_TOOL_CLOSE, PLAIN_TOOL_OPEN, tool_result_tokens


def verdict(task, problem, *turns: Turn):
    return task.verify(Trajectory(problem, turns), VerifyContext())


def test_each_kinds_code_prints_its_answer_and_the_demonstration_is_accepted():
    task = ComputeTask("c", num_heldout=200)
    problems = task.heldout() + list(islice(task.train_stream(), 200))
    assert {p.metadata["kind"] for p in problems} == set(KINDS)
    for p in problems:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(p.metadata["code"], {})  # the task's own generated code, not a model's
        assert out.getvalue().rstrip("\n") == p.answer, p.metadata
        call, tool, answer = task.demonstration(p, random.Random(0))
        assert tool == Turn("tool", p.answer) and call.text.startswith("```python\n") and call.text.endswith("\n```")
        v = verdict(task, p, call, tool, answer)
        assert v.correct and v.answered and "after a tool call" in v.reason
        assert ComputeTask("c", use_tool=False).demonstration(p, random.Random(0)) == answer.text


@pytest.mark.parametrize("reply,expected", [
    ("The answer is 3562719.", "3562719"), ("so... the answer is: 42", "42"), ("The answer is **17**.", "17"),
    ("The answer is 'cba'.", "cba"), ("The answer is 1.\nWait. The answer is 2.", "2"), ("I think 42", None),
])
def test_the_last_answer_line_is_read(reply, expected):
    assert read_answer(reply) == expected


def test_numbers_compare_as_integers_and_strings_exactly():
    task = ComputeTask("c", kinds=["multiply"], num_heldout=3)
    p = task.heldout()[0]
    with_commas = f"{int(p.answer):,}"
    assert verdict(task, p, Turn("assistant", f"The answer is {with_commas}.")).correct
    wrong = verdict(task, p, Turn("assistant", f"The answer is {int(p.answer) + 1}."))
    assert not wrong.correct and wrong.answered and "without a tool" in wrong.reason
    nothing = verdict(task, p, Turn("assistant", "```python\nprint(1)\n```"), Turn("tool", "1"), Turn("assistant", ""))
    assert (nothing.correct, nothing.answered) == (False, False)
    rev = ComputeTask("r", kinds=["reverse"], num_heldout=3)
    q = rev.heldout()[0]
    assert verdict(rev, q, Turn("assistant", f"The answer is {q.answer}.")).correct
    assert not verdict(rev, q, Turn("assistant", f"The answer is {q.answer.upper()}.")).correct


def test_a_multi_turn_demonstration_trains_the_call_and_answer_not_the_output():
    tok = CharTokenizer()
    task = ComputeTask("c", kinds=["multiply"], num_heldout=3)
    p = task.heldout()[0]
    demo = task.demonstration(p, random.Random(0))
    ids, mask = demonstration_tokens(tok, demo, tool_output_tokens=32)
    appended = tool_result_tokens(tok, p.answer, max_tokens=32).tokens
    call = tok.encode(demo[0].text)
    assert ids[len(call):len(call) + len(appended)] == list(appended)  # what the worker appends after the call
    assert tok.decode(ids) == f"{demo[0].text}{PLAIN_TOOL_OPEN}{p.answer}{PLAIN_TOOL_CLOSE}{demo[2].text}"
    assert ids[-1] == tok.eos_id and len(mask) == len(ids)
    assert mask == [1] * len(call) + [0] * len(appended) + [1] * (len(ids) - len(call) - len(appended))
    with pytest.raises(ValueError, match="tools.max_tool_output_tokens"):
        demonstration_tokens(tok, demo, tool_output_tokens=None)

    stream = DemonstrationStream({"c": task}, Renderer(tok, {"c": task}), SFTStage(type="sft", max_steps=1),
                                 seed_offset=0, rng_seed="t", tool_output_tokens=32)
    batch = stream.next_batch(4)
    assert batch.loss_masks_B is not None and batch.num_tokens == sum(map(sum, batch.loss_masks_B))
    assert all(0 < sum(m) < len(m) for m in batch.loss_masks_B)
    plain = DemonstrationStream({"c": ComputeTask("c", kinds=["multiply"], use_tool=False)}, Renderer(tok, {"c": task}),
                                SFTStage(type="sft", max_steps=1), seed_offset=0, rng_seed="t").next_batch(4)
    assert plain.loss_masks_B is None and plain.num_tokens == sum(map(len, plain.responses_B))
