"""A miniature of issue #43's pipeline (bench/pipeline_smollm2.py --quick) on CPU, so CI keeps it working: tiny
random specialists of every domain (the word problems, the computation questions with calls in the job's sandbox,
structured output, effort, and one of another architecture), the final OPD stage from the instruct stand-in and from
`rl merge` of the specialists with one teacher per sub-dataset, the multi-task baseline, and the report of every
model on every domain through `rl eval`. It checks the plumbing, not learning (the learning figures are the H200's)."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_pipeline_miniature_runs_every_phase_and_reports_every_domain(tmp_path):
    out = tmp_path / "pipe"
    done = subprocess.run([sys.executable, "bench/pipeline_smollm2.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT specialist_gain_min=\S+ opd_gap_closed_min=\S+ opd_over_baseline=\S+ "
                        r"effort_len_ratio=\S+ effort_len_increasing=[01] opd_resumed=1 audit_faults=0 domains=4",
                        result), result
    for d in ("wp", "compute", "extract", "effort"):
        assert re.search(rf"^{d} +\d\.\d{{3}} \[", done.stdout, re.M), d  # the instruct model's score, from its run
    compute = next(line for line in done.stdout.splitlines() if line.startswith("compute "))
    assert "-" not in compute.split()[1:], compute  # every column scored, the no-tool control and the merge among them
    # the OPD run was preempted by SIGTERM after the live reconfiguration and resumed to its end
    assert re.search(r"\[opd\] SIGTERM after step \d+: exit 3", done.stdout), done.stdout[-3000:]
    assert re.search(r"opd: \d+ steps, \d+ teacher loads", done.stdout)

    stage = yaml.safe_load((out / "recipes" / "opd.yaml").read_text())["stages"][0]
    teachers, datasets = stage["teachers"]["teachers"], yaml.safe_load((out / "recipes" / "opd.yaml").read_text())["datasets"]
    assert sorted(n for t in teachers for n in t["datasets"]) == sorted(d["name"] for d in datasets)  # one each
    assert len({t["name"] for t in teachers}) == len({t["checkpoint"] for t in teachers}) == len(datasets)
    assert any("/weights/step-" in t["checkpoint"] for t in teachers)  # a snapshot of an earlier step
    layers = {json.loads((Path(t["checkpoint"]) / "config.json").read_text())["num_layers"] for t in teachers}
    assert layers == {1, 2}  # a teacher of another architecture among them
    loads = [json.loads(x).get("teachers/loads", 0) for x in (out / "opd" / "metrics.jsonl").read_text().splitlines()]
    assert max(loads) >= 1
    with sqlite3.connect(out / "opd" / "trajectories.db") as c:  # the live reconfiguration: a second config version
        versions = [json.loads(v) for (v,) in c.execute("select patch_json from config_versions where status = 'applied' order by seq")]
    assert any(v.get("teachers", {}).get("extract_person") == "extract_swap" for v in versions), versions
    assert "reconfigured live: exit 0" in done.stdout
    steps = [json.loads(x) for x in (out / "opd" / "metrics.jsonl").read_text().splitlines() if '"opd/kl_loss"' in x]
    assert steps[-1]["config/version"] >= 1  # the resumed run trains at the reconfigured version, not the recipe's
    for run in ("opd", "opd_merged", "baseline"):
        assert list((out / run / "checkpoints").glob("step-*")), run
    # the SFT steps the three domains' specialists trained (two each; the baseline's SFT budget), not their log rows
    assert re.search(r"SFT steps: specialists 6, baseline 2$", done.stdout, re.M), done.stdout[-3000:]
    merged = yaml.safe_load((out / "recipes" / "opd_merged.yaml").read_text())
    assert merged["model"]["init"] == str(out / "merged") and (out / "merged" / "model.safetensors").is_file()
