"""`rl traj ls` / `rl traj show` driven through argparse against a real SQLite store."""

from __future__ import annotations

import argparse

import pytest

from model.tokenizer import CharTokenizer
from rl.store.trajectories import TrajectoryStore
from rl.cli.traj import add_traj_parser
from rl.types import Sample

pytestmark = pytest.mark.integration

TOK = CharTokenizer()


def make_sample(sample_id, *, dataset, reward, response, versions=None, finished_at, status="finished", eos=True,
                effort=None, teacher=None):
    tokens = tuple(TOK.encode(response, eos=eos))
    versions = versions or (2,) * len(tokens)
    return Sample(
        sample_id=sample_id, prompt_id=f"p-{sample_id}", dataset=dataset, group_id=f"p-{sample_id}",
        prompt_tokens=tuple(TOK.encode("What is 6*7?", bos=True)), response_tokens=tokens,
        prompt_text="What is 6*7?", response_text=response,
        behavior_logprobs_T=(-0.5,) * len(tokens), policy_versions_T=tuple(versions),
        reward=reward, correct=reward >= 1, finish_reason="eos" if eos else "length", status=status,
        timings={"finished_at": finished_at, "generate_s": 0.5}, effort=effort, teacher=teacher,
    )


SHOW_RESPONSE = "6*7 = 42\nanswer: 42"  # 19 chars + eos = 20 tokens
SHOW_VERSIONS = (3,) * 4 + (4,) * 10 + (6,) * 6


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    store = TrajectoryStore.for_run_dir(d)
    store.add_samples([
        make_sample("arith-1", dataset="arith", reward=1.0, response=SHOW_RESPONSE, versions=SHOW_VERSIONS,
                    finished_at=1),
        make_sample("arith-2", dataset="arith", reward=0.0, response="no idea", finished_at=2),
        make_sample("arith-3", dataset="arith", reward=1.0, response="x" * 200, finished_at=3, eos=False),
        make_sample("gsm-1", dataset="gsm", reward=1.0, response="42", finished_at=4, effort=50, teacher="t3"),
        make_sample("gsm-2", dataset="gsm", reward=-0.5, response="", finished_at=5, status="failed", eos=False),
    ])
    store.mark_trained(["arith-2", "gsm-1"], step=5)
    store.close()
    return d


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="rl")
    add_traj_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["traj", *map(str, argv)])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def listed_ids(out: str) -> list[str]:
    lines = out.rstrip("\n").split("\n")
    assert lines[0].split()[:2] == ["sample_id", "dataset"]
    return [line.split()[0] for line in lines[1:-1]]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], ["arith-1", "arith-2", "arith-3", "gsm-1", "gsm-2"]),
        (["--dataset", "arith", "--min-reward", "1"], ["arith-1", "arith-3"]),
        (["--dataset", "gsm"], ["gsm-1", "gsm-2"]),
        (["--max-reward", "0"], ["arith-2", "gsm-2"]),
        (["--min-reward", "-1", "--max-reward", "0.5"], ["arith-2", "gsm-2"]),
        (["--step", "5"], ["arith-2", "gsm-1"]),
        (["--step", "6"], []),
        (["--status", "failed"], ["gsm-2"]),
        (["--limit", "2"], ["arith-1", "arith-2"]),
        (["--effort", "50"], ["gsm-1"]),
        (["--teacher", "t3", "--dataset", "gsm"], ["gsm-1"]),
        (["--effort", "25"], []),
    ],
)
def test_ls_filters(run_dir, capsys, flags, expected):
    rc, out, err = run_cli(["ls", run_dir, *flags], capsys)
    assert rc == 0 and err == ""
    assert listed_ids(out) == expected
    assert out.rstrip("\n").split("\n")[-1].startswith(f"{len(expected)} samples shown")


def test_ls_columns(run_dir, capsys):
    rc, out, _ = run_cli(["ls", run_dir, "--dataset", "arith"], capsys)
    lines = out.split("\n")
    header, rows = lines[0], {line.split()[0]: line for line in lines[1:4]}
    assert header.split() == ["sample_id", "dataset", "reward", "correct", "len", "versions", "step", "response"]
    # arith-1: reward 1, correct, 20 tokens, versions 3..6, not trained, newline shown as ⏎
    assert rows["arith-1"].split()[1:8] == ["arith", "1.000", "yes", "20", "3-6", "-", "6*7"]
    assert "6*7 = 42⏎answer: 42" in rows["arith-1"]
    assert rows["arith-2"].split()[1:7] == ["arith", "0.000", "no", "8", "2-2", "5"]
    # Long responses are cut to ~40 characters.
    preview = rows["arith-3"][header.index("response"):]
    assert preview.startswith("xxxx") and 30 <= len(preview) <= 41 and "x" * 100 not in rows["arith-3"]
    # Fixed width: every column starts at the same offset on every row.
    for col in ("dataset", "response"):
        start = header.index(col)
        assert all(row[start - 2 : start] == "  " and row[start] != " " for row in rows.values())


def test_show_prints_texts_reward_segments_and_versions(run_dir, capsys):
    rc, out, err = run_cli(["show", run_dir, "arith-1"], capsys)
    assert rc == 0 and err == ""
    assert SHOW_RESPONSE in out and "What is 6*7?" in out
    assert "reward         1.0000" in out and "correct yes" in out and "finish_reason eos" in out
    assert "train step     -" in out
    assert "[0,4) v3   [4,14) v4   [14,20) v6" in out
    # The token grid: each token's text sits over its own policy version.
    grid = out.split("--- response tokens and policy versions ---\n")[1].rstrip("\n").split("\n")
    pieces, versions = [], []
    for tok_line, ver_line in zip(grid[0::2], grid[1::2]):
        assert tok_line.split()[1] == "tok" and ver_line.split()[0] == "ver"
        toks, vers = tok_line.split()[2:], ver_line.split()[1:]
        assert len(toks) == len(vers)
        pieces += toks
        versions += [int(v) for v in vers]
    expected_pieces = [{"\n": "⏎", " ": "␣"}.get(c, c) for c in SHOW_RESPONSE] + ["<eos>"]
    assert pieces == expected_pieces
    assert tuple(versions) == SHOW_VERSIONS


def test_show_token_grid_aligns_columns_and_wraps(tmp_path, capsys):
    d = tmp_path / "long"
    store = TrajectoryStore.for_run_dir(d)
    response = "".join(chr(ord("a") + i % 26) for i in range(120))
    versions = tuple(10 + (i * 95) // 120 for i in range(121))  # versions 10..104, wider than a char
    store.add_samples([make_sample("s", dataset="d", reward=0, response=response, versions=versions,
                                   finished_at=0)])
    store.close()
    rc, out, _ = run_cli(["show", d, "s"], capsys)
    grid = out.split("--- response tokens and policy versions ---\n")[1].rstrip("\n").split("\n")
    assert rc == 0 and len(grid) >= 4 and len(grid) % 2 == 0  # wrapped into several rows
    assert all(len(line) <= 100 for line in grid)
    for tok_line, ver_line in zip(grid[0::2], grid[1::2]):
        assert len(tok_line) == len(ver_line)
        # Each version's last digit sits under its token's last character.
        assert _word_ends(tok_line)[2:] == _word_ends(ver_line)[1:]  # skip the "[i]" and "tok"/"ver" labels
    assert grid[2].split()[0] != "[0]"  # later rows are labelled with their first token index


def test_show_trained_sample_and_explicit_url(run_dir, tmp_path, capsys):
    rc, out, _ = run_cli(["show", run_dir, "gsm-1", "--url", f"sqlite:///{run_dir / 'trajectories.db'}"], capsys)
    assert rc == 0 and "train step     5" in out and "dataset gsm" in out
    assert "effort         50   teacher t3" in out


def test_renamed_run_dir_still_lists(run_dir, capsys):
    moved = run_dir.rename(run_dir.parent / "renamed")
    rc, out, _ = run_cli(["ls", moved], capsys)
    assert rc == 0 and len(listed_ids(out)) == 5


def _word_ends(line: str) -> list[int]:
    return [i for i, c in enumerate(line) if c != " " and (i + 1 == len(line) or line[i + 1] == " ")]


def _assert_one_line_error(rc, out, err, *needles):
    assert rc == 2 and out == ""
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err
    for n in needles:
        assert n in err


def test_error_missing_run_dir(tmp_path, capsys):
    for cmd in (["ls", tmp_path / "nope"], ["show", tmp_path / "nope", "x"]):
        _assert_one_line_error(*run_cli(cmd, capsys), "run directory not found", "nope")


def test_error_no_database(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for cmd in (["ls", tmp_path / "empty"], ["show", tmp_path / "empty", "x"]):
        _assert_one_line_error(*run_cli(cmd, capsys), "no trajectories.db")
    assert not (tmp_path / "empty" / "trajectories.db").exists()  # reading never creates a store


def test_error_unknown_sample(run_dir, capsys):
    _assert_one_line_error(*run_cli(["show", run_dir, "arith-99"], capsys), "arith-99")


def test_error_corrupt_database(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "trajectories.db").write_text("not a database\n" * 100)
    _assert_one_line_error(*run_cli(["ls", tmp_path / "bad"], capsys), "trajectory store")
