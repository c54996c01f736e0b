"""configs/smollm2_grpo.yaml on CPU with a tiny budget: a real pretrained model (SmolLM2-135M-Instruct, GGUF)
with its own tokenizer and chat template, a JSONL dataset scored by math-verify, one GRPO step, and the
stage-end Hugging Face export that transformers reads; then configs/smollm2_opd.yaml, one OPD step whose
teacher is that GRPO run. Needs `rl models fetch smollm2-135m-instruct`
(skips without it locally; fails under CI=true, where .ci/run fetches it)."""

import json
import shutil
import sqlite3
import subprocess
import sys

import pytest

from tests.real_models import smollm2_gguf

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = ["run.device=cpu", "run.dtype=float32", "run.num_threads=2", "runtime.ray=false", "stages.0.max_steps=1", "stages.0.prompts_per_step=2",
        "stages.0.group_size=2", "stages.0.micro_batch_size=4", "stages.0.dispatch.max_inflight=4", "eval.max_problems=2",
        "engine.max_new_tokens=24", "engine.max_batch_size=8", "logging.wandb=false", "logging.progress_bar=false",
        "checkpoint.every_steps=0"]
"""The recipe's budget cut to one step. float32: the recipe's bfloat16 is for GPUs; a CPU without bf16 instructions
emulates its matmuls (the GRPO job 67 s -> 40 s on the 2-core CI machine's kind)."""


def test_one_grpo_step_of_the_smollm2_recipe_on_cpu(tmp_path):
    smollm2_gguf()  # skip (or fail under CI) without the model file
    run_dir = tmp_path / "run"
    sets = [a for s in TINY for a in ("--set", s)]
    proc = subprocess.run([*CLI, "train", "configs/smollm2_grpo.yaml", "--run-dir", str(run_dir), *sets],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "134.52M-parameter dense policy" in proc.stdout and "RESULT init_acc=" in proc.stdout and " grpo_acc=" in proc.stdout
    assert "before training: held-out accuracy 0.000 on 2 problems (answered " in proc.stdout  # eval.before_training
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        rows = c.execute("select prompt_text, reason, train_step, response_tokens from samples").fetchall()
    assert len(rows) >= 4 and sum(r[2] is not None for r in rows) == 4  # one step: 2 prompts x 2 samples trained
    for prompt_text, reason, _, _ in rows:
        assert prompt_text.startswith("<|im_start|>system\nSolve the math word problem.")  # SmolLM2's ChatML template
        assert prompt_text.endswith("<|im_start|>assistant\n")
        assert reason.startswith(("parsed ", "no answer found")), reason  # math-verify's verdicts
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["step"] == 0 and 0 <= logged[0]["eval/answered"] <= 1  # before training, with the shares
    assert any(m.get("train/tokens_per_s", 0) > 0 and m.get("rollout/tokens_per_s", 0) > 0 for m in logged)
    export = next((run_dir / "export").iterdir())
    from transformers import AutoConfig, AutoTokenizer

    from model.hf_tokenizer import load_hf_tokenizer
    from model.registry import model_path

    cfg = AutoConfig.from_pretrained(export)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    ours, theirs = load_hf_tokenizer(model_path("smollm2-135m-instruct")), AutoTokenizer.from_pretrained(export)
    text = "Mia has 63 apples. She picks 10 more apples. How many apples does Mia have now?"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)

    shutil.rmtree(run_dir / "export")  # 0.5 GB: CI machines' disks vary (the OPD run reads the checkpoint)

    # OPD: the GRPO run teaches the original model; the teacher is the run's newest checkpoint
    opd_dir = tmp_path / "opd"
    proc = subprocess.run([*CLI, "train", "configs/smollm2_opd.yaml", "--run-dir", str(opd_dir), *sets,
                           "--set", f"stages.0.teachers.teachers.0.checkpoint={run_dir}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " opd_acc=" in proc.stdout
    from rl.recipe_io import load_recipe

    teacher = load_recipe(opd_dir / "recipe.yaml").stages[0].teachers.teachers[0]
    assert teacher.checkpoint.parent == run_dir / "checkpoints"  # the saved recipe names what taught it
    with sqlite3.connect(opd_dir / "trajectories.db") as c:
        trained = c.execute("select count(*) from samples where train_step is not null").fetchone()[0]
    assert trained == 4
