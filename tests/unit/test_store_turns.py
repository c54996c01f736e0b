"""Multi-turn samples (tool calls): the `Turn` records and loss mask, the `turns` table on SQLite and PostgreSQL
(round trip, rollback), and `rl traj show` rendering a stored multi-turn sample turn by turn."""

from __future__ import annotations

import pytest

from model.tokenizer import CharTokenizer
from rl.cli import main
from rl.store.trajectories import TrajectoryStore, Watermark
from rl.store.db import sqlite_url
from rl.types import Sample, Turn
from rollout.tool_calls import PYTHON_TOOL, parse_tool_call, tool_result_tokens
from tests.unit.test_store import make_sample

TOK = CharTokenizer()
CALL_TURN = "Too big to do by hand.\n```python\nprint(2 ** 100)\n```"
OUTPUT = "1267650600228229401496703205376\n"
ANSWER_TURN = "answer: 1267650600228229"


def multi_turn_sample(sample_id: str = "mt-1") -> Sample:
    """model turn (a call) -> tool turn (its output, truncated at 16 tokens) -> model turn (the answer, EOS):
    built as the worker builds one, from the engine's tokens and rollout/tool_calls.py."""
    call = parse_tool_call(CALL_TURN, "code", [PYTHON_TOOL])
    first = TOK.encode(CALL_TURN)
    tool = tool_result_tokens(TOK, OUTPUT, max_tokens=16)
    last = TOK.encode(ANSWER_TURN, eos=True)
    a, b = len(first), len(first) + len(tool.tokens)
    tokens = (*first, *tool.tokens, *last)
    turns = (Turn("model", 0, a, text=CALL_TURN),
             Turn("tool", a, b, text=tool.output, tool=call.name, call=call.call_text, status="ok", exit_code=0,
                  truncated=tool.truncated, wall_s=0.125),
             Turn("model", b, len(tokens), text=ANSWER_TURN))
    return Sample(
        sample_id=sample_id, prompt_id="p0", dataset="bigarith", group_id="p0",
        prompt_tokens=tuple(TOK.encode("2**100?", bos=True)),
        response_tokens=tokens, prompt_text="2**100?", response_text=TOK.decode(tokens),
        behavior_logprobs_T=tuple(0.0 if a <= i < b else -0.5 for i in range(len(tokens))),
        policy_versions_T=(3,) * b + (4,) * (len(tokens) - b), reward=1.0, correct=True, finish_reason="eos",
        timings={"finished_at": 10.0, "generate_s": 0.5}, turns=turns)


def test_loss_mask_zeroes_tool_turns_only():
    x = multi_turn_sample()
    a, b = x.turns[1].start, x.turns[1].end
    mask = x.loss_mask_T()
    assert len(mask) == x.num_response_tokens and mask[:a] == (1,) * a and mask[b:] == (1,) * (len(mask) - b)
    assert mask[a:b] == (0,) * (b - a) and b - a > 16
    assert make_sample().loss_mask_T() == (1,) * 6  # no turns: every token is the model's


@pytest.mark.parametrize("turns, needle", [
    ((Turn("model", 1, 6),), "turn 0 \\[1, 6\\) does not continue at 0"),
    ((Turn("model", 0, 3), Turn("tool", 2, 6)), "turn 1 \\[2, 6\\) does not continue at 3"),
    ((Turn("model", 0, 7),), "turn 0 \\[0, 7\\) does not continue at 0 within 6"),
    ((Turn("model", 0, 4),), "turns end at 4, the response has 6 tokens"),
])
def test_turns_must_tile_the_response(turns, needle):
    with pytest.raises(ValueError, match=needle):
        make_sample(turns=turns)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    return sqlite_url(tmp_path / "t.db") if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def test_turns_round_trip_and_roll_back(url):
    store = TrajectoryStore(url, "run-a")
    x = multi_turn_sample()
    assert x.turns[1].truncated and x.turns[1].text.endswith("[tool output truncated to 16 tokens]")
    store.add_samples([x, make_sample("single")])
    wm = store.watermark(0)
    store.add_samples([multi_turn_sample("late")])
    other = TrajectoryStore(url, "run-b")  # another run, same sample id: its own turns
    other.add_samples([multi_turn_sample("mt-1")])
    y = store.get_sample("mt-1")
    assert y.turns == x.turns and y.response_tokens == x.response_tokens and y.loss_mask_T() == x.loss_mask_T()
    assert store.get_sample("single").turns == ()
    # rollback deletes the late sample's turns before the sample (the database checks the reference)
    assert store.rollback_to(wm, checkpoint="c")["samples_regenerated"] == 1
    assert store.get_sample("late") is None and store.get_sample("mt-1").turns == x.turns
    store.add_samples([multi_turn_sample("late")])  # regenerated with the same id: no stale turn rows collide
    assert store.get_sample("late").turns == x.turns and other.get_sample("mt-1").turns == x.turns
    store.close(), other.close()


def test_rl_traj_show_renders_turn_by_turn(tmp_path, capsys):
    run_dir = tmp_path / "run"
    store = TrajectoryStore.for_run_dir(run_dir)
    store.add_samples([multi_turn_sample(), make_sample("single", response_text="AAAAAA")])
    store.rollback_to(Watermark(10**6, 0), checkpoint="")  # nothing after it: a no-op that keeps the turns
    store.close()

    assert main(["traj", "show", str(run_dir), "mt-1"]) == 0
    out = capsys.readouterr().out
    assert "turns          3: 2 model, 1 tool (1 ok)" in out
    body = out.split("--- response, turn by turn ---\n")[1].split("\n\n--- response tokens")[0]
    x = multi_turn_sample()
    a, b = x.turns[1].start, x.turns[1].end
    assert body.split("\n") == [
        f"[0] model  tokens [0, {a})", *CALL_TURN.split("\n"),
        f"[1] tool   python   tokens [{a}, {b})   status ok   exit 0   0.125 s   output TRUNCATED",
        "    call │ print(2 ** 100)",
        "  output │ 1267650600228229", "         │ [tool output truncated to 16 tokens]",
        f"[2] model  tokens [{b}, {len(x.response_tokens)})", ANSWER_TURN,
    ]
    grid = out.split("--- response tokens and policy versions ---\n")[1]
    versions = " ".join(line.split(" ver ")[1] for line in grid.splitlines() if " ver " in line).split()
    assert versions == ["3"] * a + ["-"] * (b - a) + ["4"] * (len(x.response_tokens) - b)  # tool tokens: no version

    assert main(["traj", "show", str(run_dir), "single"]) == 0
    single = capsys.readouterr().out
    assert "--- response ---\nAAAAAA\n" in single and "turn" not in single.replace("train step", "")
