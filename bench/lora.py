"""Full fine-tuning against LoRA side by side (issue #44), through the policy worker's own train step and weight update,
then GRPO with LoRA and rollouts at a large shape on one device.

    python bench/lora.py --quick                      # CPU: the SmolLM2-135M shape cut to 6 layers, float32
    python bench/lora.py                              # CPU: the whole SmolLM2-135M shape (~2.5 min)
    python bench/lora.py --shape qwen3 --rank 32      # one GPU: run.dtype bfloat16 (--grpo-shape qwen3-8b by default)

Each arm is the policy worker's model on random weights of the shape (no download): `full` trains every weight, `lora`
the adapters of `model.lora` (rank --rank, every linear layer of every decoder layer). Per arm, on the same SFT batches:
the trainer's state after a step (weights, gradients, AdamW moments: rl/train/parallel.py `trainer_state_bytes`),
the peak device memory of the arm (CUDA), the median train step and its tokens/s, and the median weight update into
the engine's copy (`PolicyWorker.update_weights`: a cast copy of every weight for `full` under bf16, the merged
W + s B A of the adapted layers for `lora`; on float32 CPU the full arm shares its module with the engine and updates
nothing). `lora_equals_merged`: the LoRA model's logits against the plain model of its merged weights (the engine's
view) with adapters moved off zero, float32, within 1e-4 (and the adapters move the logits by more than 100x that).
`peft_roundtrip_max_abs_logit_diff`: a LoRA checkpoint on a tiny Qwen3 base (transformers, random weights) exported
with `rl export --adapter`'s writer and loaded onto the base by peft, against asyncrl's logits (nan without peft).

`--grpo-shape` (GPU default qwen3-8b, --quick: tiny): a GRPO job with LoRA rank --rank on every linear layer and
rollouts, in one process (rl/algo/async_grpo.py `run_async_grpo`): --grpo-prompts x --grpo-group samples a step, each
of --grpo-len response tokens (forced ends the engine learns only when they come: rewards/longtail.py `mode: eos`),
all in flight at once, random bf16 weights at the shape's real vocabulary (the char tokenizer padded to it). Reports
the samples decoding at once (mean over rollout calls), rollout tokens/s, the train step, the weight update a step
(the engine's merged copy recomputed from the base: `time/weight_update_s`), the device's peak memory, and what
`rl validate`'s memory check (rl/runtime/memory.py `check`) says of the same job with LoRA and with full fine-tuning.

Last line: RESULT lora_equals_merged=<0|1> lora_merged_max_abs_diff=<x> peft_roundtrip_max_abs_logit_diff=<x>
full_over_lora_state_bytes=<r> full_step_ms=<ms> lora_step_ms=<ms> full_update_ms=<ms> lora_update_ms=<ms>
full_peak_gib=<g> lora_peak_gib=<g> and with the GRPO job lora_<shape>_inflight=<n> lora_<shape>_tokens_per_s=<x>
lora_<shape>_update_ms=<ms> lora_<shape>_step_s=<s> lora_<shape>_peak_gib=<g> full_<shape>_fits=<0|1>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.shapes import SHAPES  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.lora import adapters_off, base_to, lora_layers, merged_copy  # noqa: E402
from model.pretrained import build_decoder  # noqa: E402
from rl.config import SFTStage  # noqa: E402
from rl.runtime.worker import refresh_rollout_copy, rollout_copy  # noqa: E402
from rl.train.objectives import build_objective  # noqa: E402
from rl.train.parallel import trainer_state_bytes  # noqa: E402
from rl.train.trainer import TrainBatch, Trainer  # noqa: E402


def build(shape: str, device: str, lora: dict | None, tokens: int, layers: int | None = None, compile: str = "off"):
    """(the trainer's model, the engine's copy or None): random weights of the shape, as `PolicyWorker` builds them
    (rl/runtime/worker.py `build_policy`, `rollout_copy`): with LoRA under bf16 the frozen base in bf16, a copy under
    bf16 and with LoRA; the training forward under torch.compile when `compile` is a mode (model/compile.py)."""
    torch.manual_seed(0)
    fields = {**SHAPES[shape], "max_position_embeddings": 2 * tokens + 16, **({"lora": lora} if lora else {}),
              **({"num_layers": layers} if layers else {})}
    model = build_decoder(ModelConfig(**fields), device=device)
    bf16 = device == "cuda"
    if bf16 and lora:
        base_to(model, torch.bfloat16)
    copy = rollout_copy(model, torch.bfloat16 if bf16 else torch.float32) if bf16 or lora else None
    if compile != "off":
        model.compile_for_training(compile)
    return model, copy


def batches(vocab: int, rows: int, tokens: int, n: int) -> list[TrainBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, 2 * tokens), generator=g).tolist()
        out.append(TrainBatch([r[:tokens] for r in ids], [r[tokens:] for r in ids], float(rows * tokens)))
    return out


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def arm(shape: str, device: str, lora: dict | None, data: list[TrainBatch], layers: int | None, compile: str = "off") -> dict:
    """The worker's train step (`Trainer.train_step` with the SFT objective) and weight update (`refresh_rollout_copy`
    after an optimizer step, then the engine's fused weights)."""
    peak_reset(device)
    model, engine = build(shape, device, lora, len(data[0].prompts_B[0]), layers, compile)
    stage = SFTStage(max_steps=1000, batch_size=len(data[0]), micro_batch_size=len(data[0]))
    trainer = Trainer(model, stage.optim, device=device, autocast=torch.bfloat16 if device == "cuda" else None)
    objective = build_objective(stage, model=model, temperature=1.0, current_version=0)

    def update():
        if engine is not None:
            refresh_rollout_copy(engine, model, frozen=False)
            engine.refresh_rollout_weights()

    steps, updates = [], []
    for b in data:
        steps.append(timed(lambda: trainer.train_step(b, objective), device))
        updates.append(timed(update, device))
    step_ms = statistics.median(steps[1:] or steps)
    tokens = sum(len(p) + len(r) for p, r in zip(data[0].prompts_B, data[0].responses_B))
    return {"model": model, "state_bytes": trainer_state_bytes(model, trainer.opt), "step_ms": step_ms,
            "tokens_per_s": tokens / step_ms * 1e3, "update_ms": statistics.median(updates[1:] or updates),
            "first_step_ms": steps[0],
            "peak_gib": peak_gib(device)}


def merged_check(model, vocab: int) -> tuple[float, float]:
    """(max |LoRA logits - merged plain model's|, max |LoRA logits - base's|) in float32, adapters moved off zero."""
    model = model.float().eval()
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(std=0.02, generator=torch.Generator(layer.lora_B.device).manual_seed(1))
        ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(2)).to(next(model.parameters()).device)
        logits = lambda m: (lambda o: o[0] if isinstance(o, tuple) else o)(m(ids)).float()  # noqa: E731
        adapted, plain = logits(model), logits(merged_copy(model))
        with adapters_off(model):
            base = logits(model)
    return float((adapted - plain).abs().max()), float((adapted - base).abs().max())


def peft_roundtrip(tmp: Path) -> float:
    """max |logits of asyncrl's LoRA model - peft's model of the exported adapter on the transformers base|, float32,
    a tiny Qwen3 of random weights with adapters moved off zero; nan without transformers and peft."""
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, Qwen3Config
    except ImportError:
        return float("nan")
    from model.checkpoint import write_weights
    from model.pretrained import export_peft_adapter

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                      head_dim=16, max_position_embeddings=64), dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.08) if p.dim() > 1 else p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(tmp / "base")
    ours = build_decoder(ModelConfig(init=str(tmp / "base"), lora={"rank": 4, "alpha": 16.0}))
    with torch.no_grad():
        for layer in lora_layers(ours).values():
            layer.lora_B.normal_(std=0.1)
    (tmp / "ckpt").mkdir()
    write_weights(ours, tmp / "ckpt", base=tmp / "base")  # adapters alone, on the base they name
    export_peft_adapter(tmp / "ckpt", tmp / "adapter")
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "base", dtype=torch.float32),
                                           tmp / "adapter").eval()(x).logits
        mine = ours.eval()(x)
    mine = mine[0] if isinstance(mine, tuple) else mine
    return float((mine - theirs).abs().max())


def grpo_recipe(shape: str, device: str, rank: int | None, prompts: int, group: int, length: int, prompt: int,
                steps: int) -> dict:
    """The GRPO job of `--grpo-shape`: every sample `length` tokens (forced ends), all of a step's in flight, the KV
    pool sized to hold them all (bf16), packed micro-batches with activation checkpointing on CUDA."""
    fields = {k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in SHAPES[shape].items()}
    inflight, seq = prompts * group, prompt + length + 16
    cuda = device == "cuda"
    return {
        "run": {"name": f"lora-grpo-{shape}", "seed": 0, "device": device, "dtype": "bfloat16" if cuda else "float32",
                "num_threads": 2},
        "tokenizer": {"type": "char", "vocab_size": fields["vocab_size"]} if fields["vocab_size"] > 99 else {"type": "char"},
        "model": {**fields, "vocab_size": max(99, fields["vocab_size"]), "max_position_embeddings": seq,
                  **({"lora": {"rank": rank, "alpha": float(rank)}} if rank else {})},
        "datasets": [{"type": "longtail", "median_tokens": length, "sigma": 0.0, "max_tokens": length, "mode": "eos",
                      "prompt_tokens": prompt}],
        "engine": {"max_batch_size": inflight, "block_size": 16, "num_blocks": inflight * -(-seq // 16) + 16,
                   "max_seq_len": seq, "max_new_tokens": length},
        "runtime": {"ray": False},
        "stages": [{"type": "grpo", "max_steps": steps, "prompts_per_step": prompts, "group_size": group,
                    "optim": {"lr": 1e-5}, "steps_per_call": 4, "activation_checkpointing": cuda,
                    **({} if cuda else {"micro_batch_size": 4}),
                    "dispatch": {"policy": "sample", "max_inflight": inflight, "max_version_lag": 1}}],
        "logging": {"wandb": False, "progress_bar": False},
        "checkpoint": {"every_steps": 0},
        "eval": {"max_problems": 1},
    }


def grpo_arm(shape: str, device: str, rank: int, prompts: int, group: int, length: int, prompt: int, steps: int,
             out: Path) -> dict:
    from rl.algo.async_grpo import run_async_grpo
    from rl.algo.job import open_job
    from rl.config import Recipe
    from rl.runtime.memory import check

    def verdict(recipe: Recipe) -> tuple[int, str]:
        try:
            return 1, check(recipe)
        except ValueError as e:
            return 0, str(e)

    full_fits, full_line = verdict(Recipe.model_validate(grpo_recipe(shape, device, None, prompts, group, length, prompt, steps)))
    recipe = Recipe.model_validate(grpo_recipe(shape, device, rank, prompts, group, length, prompt, steps))
    lora_fits, lora_line = verdict(recipe)
    print(f"  rl validate, full fine-tuning: {full_line}\n  rl validate, LoRA rank {rank}: {lora_line}", flush=True)
    peak_reset(device)
    with open_job(recipe, out, checkpoints=False, say=lambda m: None) as job:
        clock = run_async_grpo(job, recipe.stages[0], 0).clock
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"rl/loss"' in x]
    train_s = [b["time/train_s"] - a["time/train_s"] for a, b in zip([{"time/train_s": 0.0}] + rows, rows)]
    return {"inflight": clock.concurrency_mean, "inflight_max": max(clock.concurrency, default=0),
            "tokens_per_s": clock.generated_tokens / max(clock.rollout_s, 1e-9),
            "update_ms": 1e3 * clock.weight_update_s / max(len(rows), 1), "step_s": statistics.median(train_s[1:] or train_s),
            "peak_gib": peak_gib(device), "steps": len(rows), "full_fits": full_fits, "lora_fits": lora_fits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU: the SmolLM2 shape cut to 6 layers, 3 steps an arm of 2 rows")
    ap.add_argument("--layers", type=int, default=None, help="the shape's layers cut to this many")
    ap.add_argument("--shape", choices=list(SHAPES), default=None)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="prompt and response tokens of a row (each)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--arms", default="full,lora", help="the arms run, in this process (a compiled forward's graphs "
                    "stay with the process: compare first steps in one process an arm)")
    ap.add_argument("--compile", choices=["off", "layers", "ops"], default="off",
                    help="the training forward under torch.compile (run.compile's modes, model/compile.py); the first "
                         "step pays the compile")
    ap.add_argument("--grpo-shape", choices=[*SHAPES, "none"], default=None,
                    help="the GRPO job's shape (default: qwen3-8b on a GPU, tiny with --quick, none on a CPU)")
    ap.add_argument("--grpo-prompts", type=int, default=None, help="groups a step (default 16 on a GPU, 2 on a CPU)")
    ap.add_argument("--grpo-group", type=int, default=8)
    ap.add_argument("--grpo-len", type=int, default=None, help="response tokens of every sample (default 2048; CPU 16)")
    ap.add_argument("--grpo-prompt", type=int, default=None, help="prompt tokens (default 128; CPU 8)")
    ap.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default 3; CPU 2)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not a.quick else "cpu"
    shape = a.shape or ("smollm2" if a.quick or device == "cpu" else "qwen3")
    rows, tokens = a.rows or (2 if device == "cpu" else 32), a.tokens or (64 if device == "cpu" else 512)
    steps = a.steps or (3 if device == "cpu" else 10)
    a.layers = a.layers or (6 if a.quick else None)
    vocab = SHAPES[shape]["vocab_size"]
    data = batches(vocab, rows, tokens, steps)
    lora = {"rank": a.rank, "alpha": float(a.rank)}
    print(f"{shape}{f' cut to {a.layers} layers' if a.layers else ''} on {device}: {rows} rows x {tokens}+{tokens} tokens, "
          f"{steps} SFT steps an arm, LoRA rank {a.rank} on every linear layer", flush=True)
    res = {}
    for name, cfg in (("full", None), ("lora", lora)):
        if name not in a.arms.split(","):
            res[name] = {"state_bytes": float("nan"), **{k: float("nan") for k in ("step_ms", "tokens_per_s", "update_ms",
                                                                                  "peak_gib", "first_step_ms")}}
            continue
        res[name] = arm(shape, device, cfg, data, a.layers, a.compile)
        r = res[name]
        print(f"  {name:>4}: trainer state {r['state_bytes'] / 2**20:,.1f} MiB, first step {r['first_step_ms']:,.0f} ms, "
              f"then {r['step_ms']:.1f} ms "
              f"({r['tokens_per_s']:,.0f} tokens/s), weight update {r['update_ms']:.2f} ms, peak {r['peak_gib']:.2f} GiB",
              flush=True)
        if name == "full":
            del r["model"]  # one model at a time in memory
    diff, moved = merged_check(res["lora"].pop("model"), vocab) if "model" in res["lora"] else (float("nan"),) * 2
    ok = int(diff <= 1e-4 and moved > 100 * 1e-4)
    print(f"  LoRA forward against its merged plain model: max |dlogit| {diff:.2e} (the adapters move it {moved:.2e})")
    with tempfile.TemporaryDirectory() as tmp:
        peft = peft_roundtrip(Path(tmp))
    print(f"  PEFT adapter export loaded by peft onto the transformers base: max |dlogit| {peft:.2e}")
    ratio = res["full"]["state_bytes"] / res["lora"]["state_bytes"]
    line = (f"RESULT lora_equals_merged={ok} lora_merged_max_abs_diff={diff:.3g} peft_roundtrip_max_abs_logit_diff={peft:.3g} "
            f"full_over_lora_state_bytes={ratio:.3f} full_step_ms={res['full']['step_ms']:.1f} "
            f"lora_step_ms={res['lora']['step_ms']:.1f} full_update_ms={res['full']['update_ms']:.2f} "
            f"lora_update_ms={res['lora']['update_ms']:.2f} full_peak_gib={res['full']['peak_gib']:.2f} "
            f"lora_peak_gib={res['lora']['peak_gib']:.2f} full_first_step_ms={res['full']['first_step_ms']:.0f} "
            f"lora_first_step_ms={res['lora']['first_step_ms']:.0f}")
    g_shape = a.grpo_shape or ("tiny" if a.quick else "qwen3-8b" if device == "cuda" else "none")
    if g_shape != "none":
        cpu = device == "cpu"
        prompts, length = a.grpo_prompts or (2 if cpu else 16), a.grpo_len or (16 if cpu else 2048)
        prompt, steps = a.grpo_prompt or (8 if cpu else 128), a.grpo_steps or (2 if cpu else 3)
        print(f"GRPO with LoRA rank {a.rank} at the {g_shape} shape on {device}: {prompts} x {a.grpo_group} samples a step "
              f"of {prompt} + {length} tokens, all in flight, {steps} steps", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            g = grpo_arm(g_shape, device, a.rank, prompts, a.grpo_group, length, prompt, steps, Path(tmp) / "run")
        print(f"  {g['steps']} steps: {g['inflight']:.1f} samples decoding a rollout call (max {g['inflight_max']:.0f}), "
              f"{g['tokens_per_s']:,.0f} rollout tokens/s, train step {g['step_s']:.2f} s, weight update "
              f"{g['update_ms']:.1f} ms a step, peak {g['peak_gib']:.1f} GiB")
        key = g_shape.removeprefix("qwen3-").replace(".", "_") if g_shape.startswith("qwen3-") else g_shape
        line += (f" lora_{key}_inflight={g['inflight']:.1f} lora_{key}_tokens_per_s={g['tokens_per_s']:.0f} "
                 f"lora_{key}_update_ms={g['update_ms']:.1f} lora_{key}_step_s={g['step_s']:.2f} "
                 f"lora_{key}_peak_gib={g['peak_gib']:.2f} full_{key}_fits={g['full_fits']}")
    print(line)


if __name__ == "__main__":
    main()
