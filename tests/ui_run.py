"""A small finished run directory for the dashboard's tests (tests/unit/test_ui.py, tests/integration/test_ui_browser.py):
a real SQLite store with samples (one with tool turns and a reconfiguration), metrics.jsonl, recipe.yaml and run.json,
with an XSS payload in every field the dashboard shows."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from model.tokenizer import CharTokenizer
from rl.store.trajectories import TrajectoryStore
from rl.types import Sample, Turn

XSS = '<img src=x onerror="window.__xss=1">'
"""Markup that runs script if a page ever inserts a value as HTML; the page must show it as text."""
TOK = CharTokenizer()


def sample(i: int, *, dataset: str, reward: float, response: str, versions=None, teacher=None, effort=None,
           reason: str = "", turns=(), step_finished: float = 0.0) -> Sample:
    tokens = tuple(TOK.encode(response, eos=True))
    return Sample(
        sample_id=f"s{i:03d}", prompt_id=f"p{i:03d}", dataset=dataset, group_id=f"p{i:03d}",
        prompt_tokens=tuple(TOK.encode("What is 6*7?", bos=True)), response_tokens=tokens,
        prompt_text=f"What is 6*7? {XSS}", response_text=response,
        behavior_logprobs_T=tuple(-0.05 * (j % 7) for j in range(len(tokens))),
        policy_versions_T=tuple(versions or (1,) * len(tokens)), reward=reward, correct=reward >= 1,
        finish_reason="eos", status="finished", timings={"finished_at": step_finished, "generate_s": 0.1},
        teacher=teacher, effort=effort, reason=reason, turns=tuple(turns))


def make_run(d: Path, n: int = 120, name: str = f"run {XSS}", url: str | None = None) -> Path:
    """`url`: a shared store the recipe names (`store.url`) instead of the directory's own SQLite file."""
    d.mkdir(parents=True, exist_ok=True)
    recipe = {"run": {"name": "ui-test", "device": "cpu"}, "model": {"vocab_size": 99, "hidden_size": 32, "num_layers": 1,
              "num_heads": 2, "num_kv_heads": 1, "head_dim": 16}, "datasets": [{"type": "arithmetic", "name": "arith"}],
              "stages": [{"type": "sft", "max_steps": 2},
                         {"type": "grpo", "max_steps": 3, "prompts_per_step": 2, "max_staleness": 0}],
              **({"store": {"url": url}} if url else {})}
    (d / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    store = TrajectoryStore.for_run_dir(d, name=name, url=url)
    store.add_run(name, json.dumps(recipe))
    samples = []
    for i in range(n):
        response = f"6*7 = {40 + i % 5}" if i != 7 else XSS
        versions = None if i != 3 else (1,) * 5 + (2,) * (len(response) + 1 - 5)  # two segments
        if i == 61:  # trained at step 2 (weights of version 1) with three tokens of version 0: stale at max_staleness 0
            versions = (0,) * 3 + (1,) * (len(response) + 1 - 3)
        turns = ()
        if i == 9:
            response = "call: print(6*7)\n42\nanswer: 42"
            turns = (Turn(kind="model", start=0, end=17, text="call: print(6*7)\n"),
                     Turn(kind="tool", start=17, end=20, text=f"42 {XSS}\n", tool="python", call="print(6*7)",
                          status="ok", exit_code=0),
                     Turn(kind="model", start=20, end=31, text="answer: 42"))
        samples.append(sample(i, dataset="arith" if i % 3 else f"gsm {XSS}", reward=float(i % 5 == 2), response=response,
                              versions=versions, teacher=f"t{i % 2} {XSS}" if i % 4 == 0 else None,
                              effort=50 if i % 6 == 0 else None, reason=f"expected 42 {XSS}", turns=turns,
                              step_finished=float(i)))
    store.add_samples(samples)
    store.mark_trained([s.sample_id for s in samples[:60]], step=1)
    store.mark_trained([s.sample_id for s in samples[60:100]], step=2)
    for step in (1, 2, 3):  # what an RL step records in the store (rl/algo/job.py record_train_step)
        store.add_train_step(step, {"rollout/reward": step / 4, "rl/entropy": 1.0 / step,
                                    **({"eval/accuracy": 0.5} if step == 3 else {})})
    store.add_config_version(1, "applied", {"mixture": {"arith": 1.0}}, train_step=2)
    store.add_config_version(None, "refused", {"mixture": {XSS: 1.0}}, train_step=2, reason=f"unknown dataset {XSS}")
    store.close()
    with (d / "metrics.jsonl").open("w") as f:
        for step in range(1, 301):
            f.write(json.dumps({"step": step, "time": 1000.0 + step, "rollout/reward": step / 300,
                                "rollout/reward/arith": step / 250, "rollout/reward/effort50": step / 400,
                                "rl/entropy": 2.0 - step / 300, "time/rollout_s": 0.5 * step,
                                "time/train_s": 0.3 * step}) + "\n")
        f.write(json.dumps({"step": 300, "time": 1400.0, "eval/accuracy": 0.625, "eval/arith/accuracy": 0.75,
                            "eval/arith/response_len": 12.0}) + "\n")
    return d
