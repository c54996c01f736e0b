"""`rl train` with LoRA (`model.lora`, issue #44) through the real CLI, on a base file (`model.init`): SFT then GRPO
with a KL to the reference (the base, adapters off) train the adapters alone, and the checkpoints hold them alone
with the base's identity; a run killed with -9 in its GRPO stage refuses to resume onto a changed base (one line,
the run left as it was), then resumes onto the restored base to the uninterrupted run's samples and losses;
`rl export` writes the merged model."""

import json
import shutil
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

from model.checkpoint import BASE_FILE, load_config, write_weights
from model.config import ModelConfig
from model.decoder import Decoder
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
    (root / "base").mkdir()
    torch.manual_seed(0)
    write_weights(Decoder(ModelConfig(**{k: v for k, v in LORA_RECIPE["model"].items() if k != "lora"})), root / "base")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**LORA_RECIPE, "model": {**LORA_RECIPE["model"], "init": str(root / "base")}}))
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
    adapters = load_file(str(ckpt / "model.safetensors"))
    assert load_config(ckpt).lora is not None and all(k.endswith((".lora_A", ".lora_B")) for k in adapters)  # alone
    assert json.loads((ckpt / BASE_FILE).read_text())["path"] == str((root / "base").resolve())
    assert max(float(v.abs().max()) for k, v in adapters.items() if k.endswith(".lora_B")) > 0  # the adapters trained
    state = {**load_file(str(root / "base" / "model.safetensors")), **adapters}
    # the killed run refuses another base before it touches anything, then resumes onto its own to the same samples
    # and losses (the adapters and their optimizer state come back)
    killed_dir, killed, _ = done["killed"]
    assert killed.returncode == -signal.SIGKILL
    shutil.copytree(root / "base", tmp_path / "saved_base")
    ckpts = lambda: {p: p.stat().st_mtime_ns for p in (killed_dir / "checkpoints").rglob("*")}  # noqa: E731
    before = (ckpts(), _trained(killed_dir))
    torch.manual_seed(1)
    write_weights(Decoder(load_config(root / "base")), root / "base")
    refused = _run("resume", str(killed_dir))
    assert refused.returncode != 0 and "trained on the base" in refused.stderr, refused.stderr[-2000:]
    assert len([line for line in refused.stderr.splitlines() if "trained on the base" in line]) == 1
    assert (ckpts(), _trained(killed_dir)) == before  # the checkpoints and the store as they were
    shutil.rmtree(root / "base")
    shutil.copytree(tmp_path / "saved_base", root / "base")
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
