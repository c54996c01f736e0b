"""`rl train` with LoRA (`model.lora`, issue #44) through the real CLI: SFT then GRPO with a KL to the reference (the
base, adapters off) train the adapters alone; a run killed with -9 in its GRPO stage resumes to the uninterrupted
run's samples and losses; `rl export` writes the merged model."""

import json
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

from model.checkpoint import load_config
from rl.checkpoint.format import CheckpointManager
from tests.integration.test_resume import RECIPE, _assert_same_as_reference, _run, _start, _trained

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LORA_RECIPE = {**RECIPE, "run": {**RECIPE["run"], "name": "lora"},
               "model": {**RECIPE["model"], "ffn": {"type": "dense", "intermediate_size": 64},  # exportable as llama
                         "lora": {"rank": 4, "alpha": 8.0}},
               "stages": [{**RECIPE["stages"][0], "max_steps": 30, "log_every": 5},
                          {**RECIPE["stages"][1], "kl_ref_coef": 0.05}]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(LORA_RECIPE))
    envs = {"reference": {}, "killed": {"ASYNCRL_FAULT": "train:5"}}
    procs = {name: _start("train", str(recipe), "--run-dir", str(root / name), env=env) for name, env in envs.items()}
    done = {name: (root / name, p, p.communicate(timeout=300)) for name, p in procs.items()}
    return root, done


def test_lora_trains_the_adapters_alone_and_resumes_to_the_uninterrupted_run(runs, tmp_path):
    root, done = runs
    run_dir, proc, (_, err) = done["reference"]
    assert proc.returncode == 0, err[-2000:]
    samples, losses = _trained(run_dir)
    assert len(losses) == 6 and all(v != 0 for v in losses.values())
    sft = [r["sft/loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "sft/loss" in r]
    assert sft[-1] < sft[0] - 0.3, sft  # the adapters alone learn the demonstrations (4.68 -> 4.15 here)
    ckpt = CheckpointManager(run_dir / "checkpoints").latest()
    state = load_file(str(ckpt / "model.safetensors"))
    assert load_config(ckpt).lora is not None and any(k.endswith(".lora_B") for k in state)
    assert max(float(v.abs().max()) for k, v in state.items() if k.endswith(".lora_B")) > 0  # the adapters trained
    # the killed run resumes to the same samples and losses (the adapters and their optimizer state come back)
    killed_dir, killed, _ = done["killed"]
    assert killed.returncode == -signal.SIGKILL
    resumed = _run("resume", str(killed_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _assert_same_as_reference(killed_dir, (run_dir, samples, losses))
    # the export is the merged model: no adapter tensors, every adapted weight W + s B A
    export = _run("export", str(run_dir), "--out", str(tmp_path / "hf"))
    assert export.returncode == 0, export.stderr[-2000:]
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert not any("lora" in k for k in hf)
    q = "model.layers.0.self_attn.q_proj"
    merged = state[f"{q}.weight"] + 2.0 * state[f"{q}.lora_B"] @ state[f"{q}.lora_A"]
    assert torch.allclose(hf[f"{q}.weight"].float(), merged, atol=1e-6)
    assert not torch.equal(hf[f"{q}.weight"].float(), state[f"{q}.weight"])
    # --adapter: the adapters alone, in PEFT's layout (their round trip through peft: tests/unit/test_lora.py)
    adapter = _run("export", str(run_dir), "--adapter", "--out", str(tmp_path / "adapter"))
    assert adapter.returncode == 0, adapter.stderr[-2000:]
    peft = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(peft) == sorted(f"base_model.model.{k}.weight" for k in state if k.endswith((".lora_A", ".lora_B")))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
