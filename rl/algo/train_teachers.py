"""Build a zoo of heterogeneous teachers for the procedural domains (the OPD stage's teacher set, seed §5.2.4).

    python -m rl.algo.train_teachers --out runs/teachers [--num-teachers 12] [--train 4] [--steps 300]

Teacher i gets architecture ARCHITECTURES[i mod 5] (dense narrow-deep, dense wide-shallow, MoE, MQA,
no-qk-norm with tied embeddings: they differ in depth, width, heads, KV heads and FFN type, and share
only the 99-id char vocabulary) and domain DATASETS[i mod len]. The first `--train` teachers are trained
by SFT on their domain's demonstrations (teacher forcing, cross-entropy on response tokens and EOS:
rl/algo/sft.py and the trainer's SFT objective) and serve that domain; the rest keep their random
initialisation (spares for pool benchmarks, serving no dataset). Each is saved with model/checkpoint.py; `teachers.json` in the output directory is a
`TeacherPoolConfig` of them all, and each trained teacher's held-out greedy accuracy is printed and
written to `report.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from configbase import finite_float
from configbase.files import WriteRefused, atomic_write
from model.checkpoint import save_checkpoint
from model.config import ModelConfig
from model.decoder import Decoder
from model.tokenizer import CharTokenizer
from rewards.config import DEFAULT_DOMAIN_CONFIGS
from rewards.task import Task
from rl.config import OptimConfig, SFTStage
from rl.algo.evaluation import engine_generate, evaluate
from rl.train.objectives import SFTObjective
from rl.algo.rendering import Renderer
from rl.algo.sft import DemonstrationStream
from rl.train.trainer import Trainer, merge_step_metrics
from rollout.config import EngineConfig
from teachers.architectures import ARCHITECTURES, tiny
from teachers.config import TeacherPoolConfig, TeacherSpec


def sft(model: Decoder, task: Task, *, steps: int, batch_size: int = 64, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Teacher-forcing cross-entropy on the task's demonstrations (rl/algo/sft.py, the trainer's SFT objective);
    AdamW, linear warm-up then cosine decay. Returns the loss of every step."""
    stage = SFTStage(max_steps=steps, batch_size=batch_size,
                     optim=OptimConfig(lr=lr, betas=(0.9, 0.98), warmup_steps=max(1, steps // 20), schedule="cosine"))
    demos = DemonstrationStream({task.name: task}, Renderer(CharTokenizer(), {task.name: task}), stage,
                                seed_offset=seed, rng_seed=f"teacher:{seed}")
    trainer, objective = Trainer(model, stage.optim, total_steps=steps), SFTObjective(stage)
    losses = [merge_step_metrics([trainer.train_step(demos.next_batch(batch_size), objective)])["sft/loss"]
              for _ in range(steps)]
    model.eval()
    return losses


def heldout_accuracy(model: Decoder, task: Task, max_problems: int | None = None, max_new_tokens: int = 64) -> float:
    """Greedy held-out accuracy (rl/algo/evaluation.py) on an in-process engine."""
    tok = CharTokenizer()
    n = len(task.heldout()[:max_problems])
    engine = EngineConfig(max_batch_size=max(1, min(n, 256)), max_seq_len=model.config.max_position_embeddings,
                          max_new_tokens=min(max_new_tokens, model.config.max_position_embeddings - 1))
    metrics = evaluate(engine_generate(model, engine, tok.eos_id), Renderer(tok, {task.name: task}), {task.name: task},
                       max_new_tokens=engine.max_new_tokens, max_problems=max_problems)
    return metrics["eval/accuracy"]


@dataclass
class TeacherReport:
    name: str
    architecture: str
    dataset: str | None
    """The dataset the teacher serves (trained teachers); None for random-init spares."""
    params: int
    trained_steps: int
    final_loss: float | None
    heldout_accuracy: float | None
    seconds: float


def build_teachers(
    out_dir: str | Path,
    *,
    num_teachers: int,
    num_trained: int,
    steps: int,
    datasets: Sequence = DEFAULT_DOMAIN_CONFIGS,
    architectures: dict[str, ModelConfig] = ARCHITECTURES,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    eval_problems: int | None = None,
    log=print,
) -> tuple[TeacherPoolConfig, list[TeacherReport]]:
    """Save `num_teachers` teachers under out_dir/<name>, train the first `num_trained` (distinct
    domains: num_trained <= len(datasets)), write teachers.json and report.json."""
    if num_trained > min(num_teachers, len(datasets)):
        raise ValueError(f"num_trained={num_trained} exceeds min(num_teachers={num_teachers}, "
                         f"{len(datasets)} datasets): each trained teacher serves its own dataset")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch_names = list(architectures)
    specs, reports = [], []
    for i in range(num_teachers):
        arch, data_cfg = arch_names[i % len(arch_names)], datasets[i % len(datasets)]
        trained = i < num_trained
        name = f"t{i:02d}-{arch}-{data_cfg.name}" if trained else f"t{i:02d}-{arch}"
        t0 = time.perf_counter()
        torch.manual_seed(seed * 1000 + i)
        model = Decoder(architectures[arch])
        losses, acc = [], None
        if trained:
            task = data_cfg.build()
            losses = sft(model, task, steps=steps, batch_size=batch_size, lr=lr, seed=seed * 1000 + i)
            acc = heldout_accuracy(model, task, eval_problems)
        save_checkpoint(model, out / name, extra={"architecture": arch, "dataset": data_cfg.name if trained else None})
        specs.append(TeacherSpec(name=name, checkpoint=out / name, datasets=[data_cfg.name] if trained else []))
        reports.append(TeacherReport(name, arch, data_cfg.name if trained else None, model.num_parameters(),
                                     steps if trained else 0, losses[-1] if losses else None, acc,
                                     time.perf_counter() - t0))
        r = reports[-1]
        log(f"{r.name:28s} {r.params:>9,d} params  " + (
            f"sft {steps} steps loss {r.final_loss:.3f}  held-out greedy acc {acc:.3f}  ({r.seconds:.1f} s)"
            if trained else "random init"))
    pool_cfg = TeacherPoolConfig(teachers=specs)
    atomic_write(out / "teachers.json", pool_cfg.model_dump_json(indent=2))  # never through a link (configbase/files.py)
    atomic_write(out / "report.json", json.dumps([asdict(r) for r in reports], indent=2))
    return pool_cfg, reports


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (one checkpoint per teacher)")
    ap.add_argument("--num-teachers", type=int, default=12)
    ap.add_argument("--train", type=int, default=4, help="how many teachers (one per domain) to train by SFT")
    ap.add_argument("--steps", type=int, default=300, help="SFT steps per trained teacher")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=finite_float, default=3e-3)
    ap.add_argument("--domains", default=",".join(c.type for c in DEFAULT_DOMAIN_CONFIGS),
                    help="comma-separated domain types, in the order teachers are assigned to them")
    ap.add_argument("--tiny", action="store_true", help="debug-size architectures (smoke tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (these models are too small for more to pay, and shared cores stall)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    by_type = {c.type: c for c in DEFAULT_DOMAIN_CONFIGS}
    datasets = [by_type[t] for t in a.domains.split(",")]
    archs = {k: tiny(v) for k, v in ARCHITECTURES.items()} if a.tiny else ARCHITECTURES
    try:
        _, reports = build_teachers(a.out, num_teachers=a.num_teachers, num_trained=a.train, steps=a.steps,
                                    datasets=datasets, architectures=archs, batch_size=a.batch_size, lr=a.lr, seed=a.seed)
    except WriteRefused as e:  # a teacher's directory holds files already: never replaced (a new --out, or remove it)
        print(f"train_teachers: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    trained = [r for r in reports if r.heldout_accuracy is not None]
    if trained:
        print("RESULT " + " ".join(f"{r.dataset}={r.heldout_accuracy:.3f}" for r in trained))


if __name__ == "__main__":
    main()
