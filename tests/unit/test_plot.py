"""`rl plot` (rl/ui/plot.py): the standard curves of one or more runs into a PNG, SVG or PDF file, without a browser."""

from __future__ import annotations

import json

import pytest

from rl.cli.commands import main
from tests.ui_run import make_run

pytest.importorskip("matplotlib")


def test_plot_writes_each_format_with_a_panel_a_chart_that_has_data(tmp_path, capsys):
    a, b = make_run(tmp_path / "a", n=5), make_run(tmp_path / "b", n=5, name="other")
    with (b / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 301, "time": 2000.0, "rollout/tokens_per_s": 1234.5}) + "\n")
    signatures = {"png": b"\x89PNG", "pdf": b"%PDF", "svg": b"<?xml"}
    for fmt, magic in signatures.items():
        out = tmp_path / f"curves.{fmt}"
        assert main(["plot", str(a), str(b), "--out", str(out), "--metric", "rl/entropy"]) == 0
        assert out.read_bytes().startswith(magic) and out.stat().st_size > 5000
    said = capsys.readouterr().out
    assert "6 panels (reward, held-out, entropy, time split (cumulative s), tokens/s, rl/entropy)" in said
    svg = (tmp_path / "curves.svg").read_text()
    assert "tokens/s" in svg and "KL to behaviour" not in svg  # only what some run logs


def test_plot_refuses_a_bad_output_or_runs_without_metrics_in_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "a", n=5)
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.txt")]) == 2
    assert capsys.readouterr().err.strip() == f"rl plot: --out {tmp_path / 'curves.txt'}: expected a .png, .svg or .pdf file"
    (run / "metrics.jsonl").write_text("")
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no metrics to plot" in err and not (tmp_path / "c.png").exists()


def test_a_chart_takes_its_breakdowns_per_dataset_effort_and_teacher():
    from rl.ui.plot import with_breakdown

    keys = {"rollout/reward", "rollout/reward/arith", "rollout/reward/teacher_t0", "rollout/rewardx", "eval/accuracy",
            "eval/wp/accuracy", "eval/wp/response_len", "eval/a/b/accuracy"}
    assert with_breakdown(("rollout/reward",), keys) == ["rollout/reward", "rollout/reward/arith", "rollout/reward/teacher_t0"]
    assert with_breakdown(("eval/accuracy",), keys) == ["eval/accuracy", "eval/wp/accuracy"]
    assert with_breakdown(("rl/entropy",), keys) == []
