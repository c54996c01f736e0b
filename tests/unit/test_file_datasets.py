"""File datasets (rewards/datasets.py, rewards/dataset_io.py): rows to problems, the held-out split, the
train stream, every kind of bad row as one line naming the file, row and field, and the three file types."""

import itertools
import json
import random
import re

import pytest
from pydantic import TypeAdapter, ValidationError

from rewards.config import DatasetConfig
from rewards.dataset_io import DatasetError, iter_rows, json_safe
from rewards.datasets import FileDataset, JsonlDatasetConfig
from rewards.task import Message, Problem, Task, Trajectory

ROWS = [{"q": f"{a}+{b}=", "a": str(a + b), "sol": f"{a}+{b}={a + b}", "extra": [a, b]} for a in range(10) for b in range(5)]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _cfg(path, **kw):
    return TypeAdapter(DatasetConfig).validate_python({"type": "jsonl", "name": "add", "path": str(path), "prompt": "q",
                                                      "answer": "a", "verifier": "exact", **kw})


def _task(tmp_path, rows=ROWS, **kw) -> FileDataset:
    return _cfg(_write(tmp_path / "d.jsonl", rows), **kw).build()


def test_rows_become_problems_with_their_prompt_answer_and_demonstration(tmp_path):
    task = _task(tmp_path, demonstration="sol", heldout={"fraction": 0.2})
    assert isinstance(task, Task) and task.name == "add"
    p = next(p for p in task.heldout() + list(itertools.islice(task.train_stream(), 50)) if p.problem_id == "add:8")
    assert (p.prompt, p.answer, p.metadata) == ("1+2=", "3", {"row_number": 8, "demonstration": "1+2=3"})
    assert task.demonstration(p, random.Random(0)) == "1+2=3"
    assert task.verify(Trajectory.single(p, "thinking\n3")).correct and not task.verify(Trajectory.single(p, "4")).correct
    plain = _task(tmp_path, rows=[{"q": "x", "a": 7}, {"q": "y", "a": 2.5}], heldout={"fraction": 0.5})
    problems = {p.prompt: p for p in plain.heldout() + [next(plain.train_stream())]}
    assert problems["x"].answer == "7" and problems["y"].answer == "2.5"  # numbers become text
    assert plain.demonstration(problems["x"], random.Random(0)) == "7"  # no demonstration field: the answer


def test_chat_prompts_system_prompts_and_messages(tmp_path):
    row = {"q": "2+2=", "a": "4", "m": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]}
    rows = [row, dict(row, q="3+3=", a="6", m=[{"role": "user", "content": "3+3="}])]

    def prompts(**kw):
        task = _task(tmp_path, rows, heldout={"fraction": 0.5}, **kw)
        return sorted((p.prompt for p in task.heldout() + [next(task.train_stream())]), key=str)

    assert prompts() == ["2+2=", "3+3="]
    assert prompts(system="Add.") == ["Add.\n2+2=", "Add.\n3+3="]
    assert prompts(chat=True) == [(Message("user", "2+2="),), (Message("user", "3+3="),)]
    assert prompts(chat=True, system="Add.")[0] == (Message("system", "Add."), Message("user", "2+2="))
    by_messages = prompts(prompt=None, messages="m", system="Add.")
    assert (Message("system", "Add.\nBe brief."), Message("user", "2+2=")) in by_messages
    assert (Message("system", "Add."), Message("user", "3+3=")) in by_messages


def test_fraction_split_is_disjoint_deterministic_and_keeps_repeated_prompts_together(tmp_path):
    first = _task(tmp_path, heldout={"fraction": 0.2, "seed": 3}).heldout()[0]
    rows = ROWS + [{"q": first.prompt, "a": "x"}]  # a repeated held-out prompt: its second row is held out too
    task = _task(tmp_path, rows, heldout={"fraction": 0.2, "seed": 3})
    assert task.scan() == "dataset add: 40 train rows, 11 held out (10 of 50 distinct prompts (fraction 0.2, seed 3))"
    held = {p.prompt for p in task.heldout()}
    train = {p.prompt for p in itertools.islice(task.train_stream(), 400)}
    assert len(held) == 10 and len(train) == 40 and not held & train
    assert [p.problem_id for p in task.heldout()] == [p.problem_id for p in _task(tmp_path, rows, heldout={"fraction": 0.2, "seed": 3}).heldout()]
    chat = _task(tmp_path, rows, heldout={"fraction": 0.2, "seed": 3}, chat=True, system="Add.").heldout()
    assert {p.prompt[-1].content for p in chat} == held  # the split reads the row's prompt: a new system prompt keeps it
    other = {p.prompt for p in _task(tmp_path, rows, heldout={"fraction": 0.2, "seed": 4}).heldout()}
    assert other != held and len(other) == 10
    assert [p.problem_id for p in task.heldout()] == sorted((p.problem_id for p in task.heldout()), key=lambda i: int(i.split(":")[1]))


def test_heldout_file_takes_its_rows_and_drops_train_rows_that_repeat_them(tmp_path):
    _write(tmp_path / "test.jsonl", [ROWS[0], {"q": "new=", "a": "1"}])
    task = _task(tmp_path, heldout={"path": str(tmp_path / "test.jsonl")}, max_rows=20)
    assert task.scan().startswith("dataset add: 19 train rows, 2 held out (from ")
    assert [p.problem_id for p in task.heldout()] == ["add:heldout:1", "add:heldout:2"]
    assert ROWS[0]["q"] not in {p.prompt for p in itertools.islice(task.train_stream(), 100)}


def test_train_stream_is_shuffled_epochs_reproducible_per_seed_offset(tmp_path):
    task = _task(tmp_path, heldout={"fraction": 0.1})
    n = 45
    epoch = [p.problem_id for p in itertools.islice(task.train_stream(0), n)]
    assert len(set(epoch)) == n  # an epoch visits every train row once
    two = [p.problem_id for p in itertools.islice(task.train_stream(0), 2 * n)]
    assert two[:n] == epoch and sorted(two[n:]) == sorted(epoch) and two[n:] != epoch
    assert [p.problem_id for p in itertools.islice(_task(tmp_path, heldout={"fraction": 0.1}).train_stream(0), n)] == epoch
    assert [p.problem_id for p in itertools.islice(task.train_stream(1), n)] != epoch
    assert [p.problem_id for p in itertools.islice(_task(tmp_path, seed=1, heldout={"fraction": 0.1}).train_stream(0), n)] != epoch


def test_python_verifiers_receive_the_whole_row(tmp_path):
    task = _task(tmp_path, [{"q": "a", "a": "1", "hint": "x"}, {"q": "b", "a": "2", "hint": "y"}],
                 verifier="python:tests.tasks.reward_fns:echo_length", heldout={"fraction": 0.5})
    p = task.heldout()[0]
    assert p.metadata["row"] == next(r for r in [{"q": "a", "a": "1", "hint": "x"}, {"q": "b", "a": "2", "hint": "y"}] if r["q"] == p.prompt)
    assert task.verify(Trajectory.single(p, f"so {p.metadata['row']['hint']}")).reward == 0.5


BAD_ROWS = [
    ({"q": "1+1="}, "row 3: field 'a': missing"),
    ({"q": "1+1=", "a": None}, "row 3: field 'a': is null, expected a string or a number"),
    ({"q": "1+1=", "a": True}, "row 3: field 'a': is a bool (True), expected a string or a number"),
    ({"q": "1+1=", "a": "  "}, "row 3: field 'a': is empty"),
    ({"q": ["1+1="], "a": "2"}, "row 3: field 'q': is a list (['1+1=']), expected a string"),
    ('{"q": "1+1=", "a": 2', "row 3: not valid JSON (Expecting ',' delimiter at column 21)"),
    ("[1, 2]", "row 3: not a JSON object (a JSON list)"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS, ids=[m.split(": ", 2)[-1][:30] for _, m in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_file_row_and_field(tmp_path, bad, message):
    path = _write(tmp_path / "d.jsonl", [ROWS[0], ""] + [bad] + ROWS[1:])  # line 2 is blank: rows count lines
    with pytest.raises(ValidationError) as e:  # within the first rows: `rl validate` sees it
        _cfg(path)
    assert f"{path}: {message}" in str(e.value)
    late = _write(tmp_path / "late.jsonl", ROWS[:9] + [bad] + ROWS[9:])
    task = _cfg(late).build()  # row 10: beyond what validation reads
    with pytest.raises(DatasetError) as e:
        task.scan()
    assert str(e.value) == f"{late}: {message.replace('row 3', 'row 10')}" and "\n" not in str(e.value)


@pytest.mark.parametrize("messages, message", [
    ("hi", "is a str ('hi'), expected a non-empty list of {role, content}"),
    ([], "is a list ([]), expected a non-empty list of {role, content}"),
    ([{"role": "bot", "content": "x"}], "message 0 is {'role': 'bot', 'content': 'x'}, expected {role: system | user | assistant, content: string}"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "ends with a assistant message; the last message must be the user's"),
])
def test_bad_messages(tmp_path, messages, message):
    path = _write(tmp_path / "d.jsonl", [{"m": messages, "a": "1"}])
    with pytest.raises(ValidationError, match=re.escape(f"d.jsonl: row 1: field 'm': {message}")):
        _cfg(path, prompt=None, messages="m")


def test_file_level_errors(tmp_path):
    with pytest.raises(ValidationError, match=f"{tmp_path / 'nope.jsonl'}: file not found"):
        _cfg(tmp_path / "nope.jsonl")
    with pytest.raises(ValidationError, match=r"empty.jsonl: no rows \(empty file\)"):
        _cfg(_write(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(ValidationError, match="is not a file"):
        _cfg(tmp_path)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"q": "caf\xe9", "a": "1"}\n')
    with pytest.raises(ValidationError, match=r"latin1.jsonl: row 1: not UTF-8 text \(invalid continuation byte at byte 10\)"):
        _cfg(tmp_path / "latin1.jsonl")
    (tmp_path / "bom.jsonl").write_bytes('\ufeff{"q": "x", "a": "1"}\n{"q": "y", "a": "2"}\n'.encode())
    assert _cfg(tmp_path / "bom.jsonl").build().scan()
    with pytest.raises(DatasetError, match="has 1 distinct prompt"):
        _task(tmp_path, [ROWS[0], ROWS[0]]).scan()
    with pytest.raises(ValidationError, match=r"test.jsonl: row 1: field 'a': missing"):  # the held-out file is checked too
        _cfg(_write(tmp_path / "d.jsonl", ROWS), heldout={"path": str(_write(tmp_path / "test.jsonl", [{"q": "x"}]))})
    with pytest.raises(DatasetError, match=r"row 2: field 'a': '\?\?\?' is not parseable by math-verify"):
        _task(tmp_path, [ROWS[0], {"q": "x", "a": "???"}], verifier="math").scan()


def test_config_rules(tmp_path):
    path = _write(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValidationError, match="give exactly one of prompt"):
        _cfg(path, messages="m")
    with pytest.raises(ValidationError, match="give exactly one of prompt"):
        _cfg(path, prompt=None)
    with pytest.raises(ValidationError, match="chat applies to a text prompt"):
        _cfg(path, prompt=None, messages="m", chat=True)
    with pytest.raises(ValidationError, match="not both"):
        _cfg(path, heldout={"fraction": 0.1, "path": str(path)})
    with pytest.raises(ValidationError, match="heldout.split applies to hf_disk datasets only"):
        _cfg(path, heldout={"split": "test"})
    with pytest.raises(ValidationError, match="unknown verifier 'fuzzy'"):
        _cfg(path, verifier="fuzzy")
    cfg = _cfg(path)
    assert cfg.heldout.fraction == 0.1 and cfg.verifier.type == "exact"
    assert TypeAdapter(DatasetConfig).validate_python(cfg.model_dump(mode="json")) == cfg  # a run's resolved recipe loads back
    assert JsonlDatasetConfig(name="x", path=path, prompt="q", answer="a", verifier={"type": "math", "timeout_s": 3}).verifier.timeout_s == 3


def test_rows_only_load_when_needed(tmp_path):
    path = _write(tmp_path / "d.jsonl", ROWS)
    task = _cfg(path).build()
    path.write_text("")  # a reward worker builds the task only to verify: it never reads the file
    assert task.verify(Trajectory.single(Problem("add:8", "add", "1+2=", "3", {"row_number": 8}), "3")).correct
    with pytest.raises(DatasetError, match="no rows"):
        task.scan()


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import datetime

    table = pa.table({"q": [r["q"] for r in ROWS], "a": [int(r["a"]) for r in ROWS],
                      "when": [datetime.date(2024, 1, 1)] * len(ROWS), "raw": [b"\x00\x01"] * len(ROWS)})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    task = _cfg(tmp_path / "d.parquet", type="parquet", verifier="python:tests.tasks.reward_fns:graded").build()
    assert task.scan().startswith("dataset add: 45 train rows, 5 held out")
    p = task.heldout()[0]
    assert p.metadata["row"] == {"q": p.prompt, "a": int(p.answer), "when": "2024-01-01", "raw": "AAE="}  # JSON values
    json.dumps(p.to_record())
    pq.write_table(table.drop_columns(["a"]), tmp_path / "noa.parquet")
    with pytest.raises(ValidationError, match=r"noa.parquet: row 1: field 'a': missing"):
        _cfg(tmp_path / "noa.parquet", type="parquet")
    pq.write_table(table.set_column(1, "a", pa.array([1, 2, 3, 4, 5, 6, None] + [1] * 43)), tmp_path / "null.parquet")
    with pytest.raises(DatasetError, match=r"null.parquet: row 7: field 'a': is null"):
        _cfg(tmp_path / "null.parquet", type="parquet").build().scan()
    _write(tmp_path / "fake.parquet", ROWS[:2])
    with pytest.raises(ValidationError, match=r"fake.parquet: cannot read as Parquet"):
        _cfg(tmp_path / "fake.parquet", type="parquet")


def test_hf_disk_rows_and_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    task = _cfg(tmp_path / "one", type="hf_disk", heldout={"fraction": 0.2}).build()
    assert task.scan().startswith("dataset add: 40 train rows, 10 held out")
    assert {p.prompt for p in task.heldout()} <= {r["q"] for r in ROWS}
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:40]), "test": datasets.Dataset.from_list(ROWS[40:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    task = _cfg(tmp_path / "dd", type="hf_disk", split="train", heldout={"split": "test"}).build()
    assert task.scan().startswith("dataset add: 40 train rows, 10 held out (from ") and task.heldout()[0].prompt == ROWS[40]["q"]
    with pytest.raises(ValidationError, match=r"dd: holds the splits \['test', 'train'\]: name one with `split:`"):
        _cfg(tmp_path / "dd", type="hf_disk")
    with pytest.raises(ValidationError, match="has no split 'dev'"):
        _cfg(tmp_path / "dd", type="hf_disk", split="dev")
    with pytest.raises(ValidationError, match="is not a directory"):
        _cfg(_write(tmp_path / "d.jsonl", ROWS), type="hf_disk")
    with pytest.raises(ValidationError, match="cannot load with datasets.load_from_disk"):
        _cfg(tmp_path, type="hf_disk")


def test_a_missing_extra_is_one_line_naming_the_package(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_arrow(name, *args, **kw):
        if name.startswith(("pyarrow", "datasets")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_arrow)
    monkeypatch.setattr("importlib.import_module", lambda name: no_arrow(name))
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"reading a `type: parquet` dataset needs the pyarrow package: pip install pyarrow "
                                           r"\(or pip install -e \"\.\[data\]\"\)"):
        list(iter_rows("parquet", tmp_path / "d.parquet"))
    (tmp_path / "hf").mkdir()
    with pytest.raises(DatasetError, match="needs the datasets package: pip install datasets"):
        list(iter_rows("hf_disk", tmp_path / "hf"))


def test_json_safe():
    import datetime
    import decimal

    assert json_safe({"a": [b"\xff", datetime.datetime(2024, 1, 2, 3, 4), decimal.Decimal("1.5")], 1: (1, None)}) == \
        {"a": ["/w==", "2024-01-02T03:04:00", "1.5"], "1": [1, None]}


def test_skip_rows_and_max_rows_split_one_file_between_two_datasets(tmp_path):
    _write(tmp_path / "test.jsonl", [{"q": "new=", "a": "1"}])
    held = {"path": str(tmp_path / "test.jsonl")}
    first, rest = _task(tmp_path, heldout=held, max_rows=20), _task(tmp_path, heldout=held, skip_rows=20)
    window = _task(tmp_path, heldout=held, skip_rows=20, max_rows=5)
    rows = [sorted(p.metadata["row_number"] for p in itertools.islice(t.train_stream(), n)) for t, n in
            ((first, 20), (rest, 30), (window, 5))]
    assert rows == [list(range(1, 21)), list(range(21, 51)), list(range(21, 26))]  # one epoch each: the rows, once
    assert rest.scan().startswith("dataset add: 30 train rows, 1 held out")
    assert [p.answer for p in rest.heldout()] == ["1"]  # the held-out file is read whole
    with pytest.raises(ValidationError, match=re.escape("d.jsonl: no rows after the first 50 (skip_rows)")):
        _task(tmp_path, heldout=held, skip_rows=50)


def test_where_makes_sub_datasets_of_one_file_train_and_held_out(tmp_path):
    rows = [dict(r, kind="small" if int(r["a"]) < 5 else "large") for r in ROWS]
    held = _write(tmp_path / "h.jsonl", rows[::7])
    small = _task(tmp_path, rows, where={"kind": "small"}, heldout={"path": str(held)})
    large = _task(tmp_path, rows, where={"kind": ["large"]}, heldout={"path": str(held)})
    both = _task(tmp_path, rows, where={"kind": ["small", "large"]}, heldout={"path": str(held)})
    train = {name: {p.prompt for p in itertools.islice(t.train_stream(), 400)} for name, t in
             (("small", small), ("large", large), ("both", both))}
    assert train["small"] and train["large"] and not train["small"] & train["large"]
    assert train["small"] | train["large"] == train["both"]
    assert all(int(p.answer) < 5 for p in small.heldout()) and all(int(p.answer) >= 5 for p in large.heldout())
    assert len(small.heldout()) + len(large.heldout()) == len(held.read_text().splitlines())
    with pytest.raises(DatasetError, match="no rows match where"):
        _task(tmp_path, rows, where={"kind": "medium"}).scan()
    with pytest.raises(ValidationError, match="has no field 'size'"):
        _task(tmp_path, rows, where={"size": 3})


def test_direct_demonstration_is_the_cold_starts_answer_without_reasoning(tmp_path):
    """seed §5.1.4's cold start on a file: at level b the template (the answer alone) with probability 1 - b/100."""
    task = _task(tmp_path, demonstration="sol", direct_demonstration="So: {a} (from {q})", heldout={"fraction": 0.2})
    p = next(p for p in task.heldout() + list(itertools.islice(task.train_stream(), 50)) if p.problem_id == "add:8")
    assert p.metadata["direct_demonstration"] == "So: 3 (from 1+2=)"
    rng = random.Random(0)
    assert task.demonstration(p, rng) == "1+2=3"  # no cold start: the demonstration
    assert task.demonstration(p, rng, direct_answer_rate=1.0) == "So: 3 (from 1+2=)"
    assert task.demonstration(p, rng, direct_answer_rate=0.0) == "1+2=3"
    assert task.demonstration(p, rng, reasoning_frac=1.0) == "1+2=3"
    share = sum(task.demonstration(p, rng, direct_answer_rate=0.3) != "1+2=3" for _ in range(2000)) / 2000
    assert 0.25 < share < 0.35, share
    share = sum(task.demonstration(p, rng, reasoning_frac=0.3) != "1+2=3" for _ in range(2000)) / 2000
    assert 0.65 < share < 0.75, share
    with pytest.raises(ValueError, match=r"d\.jsonl: row 1: field 'nope': is missing .* direct_demonstration"):
        _task(tmp_path, direct_demonstration="{nope}")  # the recipe's load reads the first rows
