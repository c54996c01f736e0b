"""How long a background checkpoint stops the rollouts (issue #41: the SmolLM2 job's GPU idle share).

    python bench/checkpoint_pause.py [--quick] [--device cuda] [--samples 256] [--prompt 80] [--steps 20]

A policy worker of SmolLM2-135M's shape (random weights: the pause depends on the bytes, not their values; 30
layers, hidden 576, 9/3 heads, FFN 1536, vocabulary 49,152) with its AdamW state, `--samples` samples in flight
after `--steps` decode steps from `--prompt`-token prompts, interrupted in place (`engine.park_kv: pool`, as in the
job). Two arms, in turn, `--repeats` times each, in one process:
- `before`: the pause as it was: the weights and the optimizer state copied into fresh host memory, the in-flight
  states exported and serialised (each state's bytes joined, then packed into one msgpack blob);
- `after`: `PolicyWorker.save(background=True)`'s synchronous part as it is: the trainer's tensors into host buffers
  kept from the previous checkpoint (rl/checkpoint/host_copies.py), the states exported and their file made of views
  of their tensors (rollout/types.py `states_file_parts`; a thread writes it).
The first `after` also allocates its buffers: its time is reported apart (`after_first_s`) and left out of the
median. Each arm's files are written by the worker's thread and checked to read back the same states.
Last line: RESULT pause_before_s=.. pause_after_s=.. speedup=.. after_first_s=.. after_trainer_copy_s=..
after_inflight_s=.. (the parts of `after`, as the worker reports them) state_mb=.. trainer_mb=..
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import msgpack
import torch

from rl.checkpoint.format import inflight_file
from rl.config import Recipe
from rl.runtime.worker import PolicyWorker
from rollout.types import GenerationRequest, states_on_host

SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64,
           "ffn": {"type": "dense", "intermediate_size": 1536}, "tie_word_embeddings": True}


def recipe(a) -> Recipe:
    return Recipe.model_validate({
        "run": {"name": "checkpoint-pause", "seed": 0, "device": a.device, "num_threads": a.threads,
                **({"dtype": "bfloat16"} if a.device == "cuda" else {})},
        "model": {**SMOLLM2, "max_position_embeddings": a.prompt + a.steps + 16},
        "tokenizer": {"type": "char", "vocab_size": SMOLLM2["vocab_size"]},
        "datasets": [{"type": "arithmetic"}],
        "engine": {"max_batch_size": a.samples, "block_size": 16, "max_seq_len": a.prompt + a.steps + 16,
                   "max_new_tokens": a.steps + 8, "park_kv": "pool"},
        "stages": [{"type": "grpo", "max_steps": 1, "prompts_per_step": a.samples // 8, "group_size": 8,
                    "optim": {"lr": 1e-5}, "dispatch": {"max_inflight": a.samples}}],
        "runtime": {"ray": False},
        "logging": {"wandb": False, "progress_bar": False},
    })


def old_pause(w: PolicyWorker) -> tuple[dict, dict, bytes]:
    """The synchronous part of a background save before issue #41's change (the copies it made, then the blob)."""
    def fresh(tree):
        if torch.is_tensor(tree):
            return tree.detach().to("cpu", copy=True)
        if isinstance(tree, dict):
            return {k: fresh(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(fresh(v) for v in tree)
        return copy.deepcopy(tree)

    weights = {k: v.detach().to("cpu", copy=True) for k, v in w.model.state_dict().items()}
    optimizer = fresh(w.trainer.opt.state_dict())
    blob = msgpack.packb([s.to_bytes() for s in states_on_host(w.engine.snapshot())])
    return weights, optimizer, blob


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 samples, 4 steps, 2 repeats (CPU, under 60 s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=80)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.quick:
        a.samples, a.prompt, a.steps, a.repeats = 64, 48, 4, 2
    torch.manual_seed(0)
    r = recipe(a)
    w = PolicyWorker(r)
    w.begin_stage(r.stages[0])
    for p in (p for g in w.trainer.opt.param_groups for p in g["params"]):  # the AdamW moments exist
        p.grad = torch.zeros_like(p)
    w.trainer.opt.step()
    w.trainer.opt.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    w.add_requests([GenerationRequest(f"p{i // 8}-{i % 8}", tuple(torch.randint(3, 40000, (a.prompt,), generator=g).tolist()),
                                      a.steps + 8, seed=i, ignore_eos=True) for i in range(a.samples)])
    t0 = time.perf_counter()
    w.rollout(a.steps)
    print(f"{a.samples} samples decoded {a.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    w.interrupt()
    expect = [s.to_bytes() for s in states_on_host(w.engine.snapshot())]
    state_mb = sum(map(len, expect)) / 1e6
    trainer_mb = sum(p.nbytes for p in w.model.parameters()) / 1e6 * 3  # weights and two AdamW moments

    times: dict[str, list[float]] = {"before": [], "after": []}
    parts: dict[str, list[float]] = {"trainer_copy": [], "inflight": []}  # of `after`: PolicyWorker.save's report
    after_first = None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats + 1):
            for arm in ("before", "after") if i else ("after",):  # round 0: the buffers' first allocation
                d = Path(tmp) / f"{arm}-{i}"
                d.mkdir()
                sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                if arm == "before":
                    weights, optimizer, blob = old_pause(w)
                    dt = time.perf_counter() - t0
                    inflight_file(d, 0).write_bytes(blob)
                    del weights, optimizer
                else:
                    report = w.save(str(d), background=True)
                    dt = time.perf_counter() - t0
                    w.wait_saved()
                    if i:
                        parts["trainer_copy"].append(report["trainer_copy_s"])
                        parts["inflight"].append(report["inflight_s"])
                got = msgpack.unpackb(inflight_file(d, 0).read_bytes())
                assert got == expect, f"{arm}: the in-flight file differs"
                if i == 0:
                    after_first = dt
                else:
                    times[arm].append(dt)
                print(f"{arm} round {i}: pause {dt * 1000:.0f} ms", flush=True)
    w.resume()
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"state {state_mb:.0f} MB in flight, trainer {trainer_mb:.0f} MB; pause before {before:.3f} s, after "
          f"{after:.3f} s (first {after_first:.3f} s)")
    copy_s, inflight_s = statistics.median(parts["trainer_copy"]), statistics.median(parts["inflight"])
    print(f"of the pause after: the trainer's state copied {copy_s:.3f} s, the in-flight states exported {inflight_s:.3f} s")
    print(f"RESULT pause_before_s={before:.4f} pause_after_s={after:.4f} speedup={before / after:.2f} "
          f"after_first_s={after_first:.4f} after_trainer_copy_s={copy_s:.4f} after_inflight_s={inflight_s:.4f} "
          f"state_mb={state_mb:.0f} trainer_mb={trainer_mb:.0f}")


if __name__ == "__main__":
    main()
