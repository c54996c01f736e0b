"""Threat model of issue #13: a run directory, a checkpoint, a model directory or a tokenizer is untrusted data.
A payload (a canary file write) is planted in every file that `rl resume` reads from a run directory and in
every file that `rl train` reads from a Hugging Face model directory and from a GGUF tokenizer, one file per
case, through the real CLI in subprocesses. Each case ends in a clean exit or one line with exit 2, never a
traceback, and the canary never appears: nothing in those files runs.

Payloads: a pickle that writes the canary when unpickled (in every file, digests in the manifest rewritten so
that the bytes reach the parser), a YAML python tag, a chat template that escapes Jinja's sandbox, and
`auto_map` entries that name a module of the directory which writes the canary on import."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.payloads import pickle_payload

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
ROOT = Path(__file__).resolve().parents[2]


def jinja_payload(canary: Path) -> str:
    """A chat template that writes `canary` if Jinja's sandbox lets it reach a function's globals."""
    return "{{ cycler.__init__.__globals__.os.system('touch " + str(canary) + "') }}{{ messages[0]['content'] }}"


def module_payload(canary: Path) -> str:
    return f"open({str(canary)!r}, 'w').close()\nclass Evil: pass\n"


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _problem(proc: subprocess.CompletedProcess, canary: Path) -> str | None:
    """Why the case is not clean, or None."""
    if canary.exists():
        return "the planted payload ran"
    if "Traceback" in proc.stderr or proc.returncode not in (0, 2):
        return f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    if proc.returncode == 2 and len(proc.stderr.strip().splitlines()) != 1:
        return f"not one line: {proc.stderr[-1500:]}"
    return None


def _run_all(cases: dict[str, tuple[list[str], Path]]) -> dict[str, subprocess.CompletedProcess]:
    # three at a time on two cores: a case's process also waits on its files (each runs with one thread)
    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = dict(zip(cases, pool.map(lambda c: _cli(c[0]), cases.values())))
    problems = {what: p for what, proc in procs.items() if (p := _problem(proc, cases[what][1]))}
    assert not problems, "\n".join(f"{what}: {p}" for what, p in problems.items())
    return procs


# -- rl resume: every file of the run directory and of its newest checkpoint ------------------------------------
def test_no_file_a_resume_reads_runs_code(tmp_path, tiny_grpo_run):
    base = tiny_grpo_run  # `rl train configs/tiny_grpo.yaml`, finished (tests/integration/conftest.py); copied below
    newest = sorted((base / "checkpoints").glob("step-*"))[-1]
    planted = sorted(p.relative_to(base) for p in [*base.iterdir(), *newest.iterdir()]
                     if p.is_file() and not p.name.endswith(".lock"))
    assert {"recipe.yaml", "run.json", "trajectories.db", "controller.json", "trainer.json", "trainer.safetensors",
            "model.safetensors", "config.json", "MANIFEST.json"} <= {p.name for p in planted}
    assert any(p.name.startswith("inflight-") for p in planted)  # the in-flight rollout states (msgpack)

    cases = {}
    for i, rel in enumerate(planted):
        run, canary = tmp_path / f"case{i}", tmp_path / f"canary{i}"
        shutil.copytree(base, run)
        target = run / rel
        if rel.name == "recipe.yaml":  # a YAML python tag rather than a pickle
            target.write_text(f"!!python/object/apply:os.system ['touch {canary}']\n")
        else:
            target.write_bytes(pickle_payload(canary))
        manifest = target.parent / "MANIFEST.json"
        if target.parent != run and rel.name != "MANIFEST.json":  # the bytes pass the integrity check
            m = json.loads(manifest.read_text())
            m["files"][rel.name] = {"bytes": target.stat().st_size,
                                    "blake2b": hashlib.blake2b(target.read_bytes()).hexdigest()}
            manifest.write_text(json.dumps(m))
        cases[str(rel)] = (["resume", str(run), "--set", "stages.0.max_steps=3"], canary)
    procs = _run_all(cases)
    # a damaged checkpoint file is skipped for the previous checkpoint; a damaged run file is refused
    assert procs["recipe.yaml"].returncode == 2 and procs["trajectories.db"].returncode == 2
    assert procs[str(newest.relative_to(base) / "controller.json")].returncode == 0


# -- rl train: every file of a Hugging Face model directory, and a GGUF tokenizer ------------------------------
def _hf_model_dir(d: Path) -> Path:
    from tests.hf_tiny import make_hf
    from tests.tiny_tokenizer import write_hf_dir

    make_hf("llama", d, vocab_size=600, max_position_embeddings=256, rope_scaling=None)
    write_hf_dir(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 1}))
    return d


def _recipe(tmp_path: Path, tokenizer: dict, model: dict) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a} + 1 = ?", "a": str(a + 1)}) + "\n" for a in range(40)))
    recipe = {"run": {"name": "payloads", "seed": 0, "num_threads": 1}, "model": model, "tokenizer": tokenizer,
              "datasets": [{"type": "jsonl", "name": "inc", "path": str(data), "prompt": "q", "answer": "a", "chat": True,
                            "system": "Answer.", "verifier": "exact", "heldout": {"fraction": 0.1}}],
              "engine": {"max_batch_size": 8, "max_seq_len": 96, "max_new_tokens": 4}, "runtime": {"ray": False},
              "stages": [{"type": "grpo", "max_steps": 1, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4,
                          "dispatch": {"max_inflight": 4}}],
              "eval": {"max_problems": 2}, "checkpoint": {"every_steps": 0},
              "logging": {"wandb": False, "progress_bar": False}}
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_no_file_a_model_load_reads_runs_code(tmp_path):
    pytest.importorskip("transformers")
    base = _hf_model_dir(tmp_path / "base")
    files = sorted(p.name for p in base.iterdir() if p.is_file())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files)

    # the clean directory trains (checked below): the cases reach the loader; it runs in the cases' pool
    clean = "the clean directory"
    cases = {clean: (["train", str(_recipe(tmp_path, {"type": "hf"}, {"init": str(base)})), "--run-dir", str(tmp_path / "ok")],
                     tmp_path / "canary-clean")}

    def case(what: str, plant) -> None:
        i = len(cases)
        d, canary = tmp_path / f"m{i}", tmp_path / f"canary{i}"
        shutil.copytree(base, d)
        plant(d, canary)
        recipe = _recipe(tmp_path, {"type": "hf"}, {"init": str(d)})
        cases[what] = (["train", str(recipe), "--run-dir", str(tmp_path / f"run{i}")], canary)

    for name in files:
        case(f"pickle in {name}", lambda d, c, name=name: (d / name).write_bytes(pickle_payload(c)))

    def remote_code(d: Path, c: Path, file: str, key: str) -> None:
        (d / "evil_code.py").write_text(module_payload(c))
        cfg = json.loads((d / file).read_text())
        cfg["auto_map"] = {key: "evil_code.Evil"}
        (d / file).write_text(json.dumps(cfg))

    case("auto_map in config.json", lambda d, c: remote_code(d, c, "config.json", "AutoModelForCausalLM"))
    case("auto_map in tokenizer_config.json", lambda d, c: remote_code(d, c, "tokenizer_config.json", "AutoTokenizer"))

    def template(d: Path, c: Path) -> None:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = jinja_payload(c)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))

    case("chat template escaping the sandbox", template)

    from tests.tiny_tokenizer import write_gguf
    gi, gguf_canary = len(cases), tmp_path / "canary-gguf"
    gguf = write_gguf(tmp_path / "tok.gguf", template=jinja_payload(gguf_canary))
    cases["chat template in a GGUF tokenizer"] = (
        ["train", str(_recipe(tmp_path, {"type": "hf", "path": str(gguf)}, {"vocab_size": 640, "hidden_size": 32,
                                                                            "num_layers": 1, "num_heads": 2,
                                                                            "num_kv_heads": 1, "head_dim": 16,
                                                                            "max_position_embeddings": 128,
                                                                            "ffn": {"type": "dense",
                                                                                    "intermediate_size": 64}})),
         "--run-dir", str(tmp_path / f"run{gi}")], gguf_canary)

    procs = _run_all(cases)
    ok = procs.pop(clean)
    assert ok.returncode == 0, ok.stderr[-2000:]
    for what in ("pickle in config.json", "pickle in model.safetensors", "pickle in tokenizer.json",
                 "chat template escaping the sandbox", "chat template in a GGUF tokenizer"):
        assert procs[what].returncode == 2, what  # refused, with one line (checked above)
