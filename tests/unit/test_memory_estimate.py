"""`rl validate`'s memory estimate (rl/runtime/memory.py, issue #13): the parts it counts equal what the worker
allocates, and a recipe that cannot fit is refused with the figure in one line."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from model.decoder import Decoder
from model.token_logprobs import DEFAULT_CHUNK_BYTES
from rl.runtime.memory import PARTS, activation_bytes_per_token, estimate
from rl.recipe_io import load_recipe
from rl.runtime.worker import PolicyWorker
from rollout.engine import Engine

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


@pytest.mark.parametrize("config, sets", [
    ("configs/quickstart.yaml", []),
    ("configs/effort.yaml", ["model.kv_cache.dtype=fp4"]),
    ("configs/quickstart.yaml", ["engine.num_blocks=200", "model.kv_cache.dtype=fp8", "stages.1.kl_ref_coef=0.1"]),
    ("configs/quickstart.yaml", ["run.dtype=bfloat16"]),
    ("configs/quickstart.yaml", ["stages.1.micro_batch_tokens=100000"]),
    ("configs/quickstart.yaml", ["engine.kv_gib=0.01", "model.kv_cache.dtype=fp4"]),  # an amount in the format's bytes
])
def test_the_estimate_counts_what_the_worker_allocates(config, sets):
    recipe = load_recipe(config, sets)
    parts = estimate(recipe)
    model = Decoder(recipe.model)
    assert parts["parameters"] == model.num_parameters() and parts["weights"] == 4 * model.num_parameters()
    assert parts["adamw"] == 2 * parts["weights"]
    assert parts["reference"] == (parts["weights"] if any(getattr(s, "kl_ref_coef", 0) for s in recipe.stages) else 0)
    bf16 = recipe.run.dtype == "bfloat16"
    assert parts["engine_weights"] == (2 * model.num_parameters() if bf16 else 0)
    cache = PolicyWorker(recipe).engine.cache if bf16 else Engine(model, recipe.engine, eos_id=0).cache
    pool = sum(t.numel() * t.element_size() for t in cache._tensors().values())  # noqa: SLF001 - what it holds
    slots = cache.k.shape[1]
    assert parts["kv_pool"] == pytest.approx(pool * (slots - 1) / slots)  # the scratch slot aside
    e = recipe.engine  # the output head runs on response positions: max_new_tokens per rollout, max_seq_len per demonstration
    positions = [s.micro_batch_tokens or (s.micro_batch_size or s.batch_size if s.type == "sft" else s.micro_batch_size)
                 * (e.max_seq_len if s.type == "sft" else e.max_new_tokens) for s in recipe.stages]
    # GRPO and SFT stages hold one chunk of model/token_logprobs.py's path; OPD's full-vocabulary loss every position
    chunk = max(64, DEFAULT_CHUNK_BYTES // (4 * recipe.model.vocab_size))
    assert parts["logits"] == max(3 * (n if s.type == "opd" else min(n, chunk)) * recipe.model.vocab_size * 4
                                  for n, s in zip(positions, recipe.stages))
    # a micro-batch's tokens (its rows at the longest a row can be, or micro_batch_tokens) × what each keeps
    tokens = [s.micro_batch_tokens or (s.micro_batch_size or getattr(s, "batch_size", 1)) * e.max_seq_len
              for s in recipe.stages]
    assert parts["activations"] == max(n * activation_bytes_per_token(recipe.model, bf16) for n in tokens) > 0
    assert parts["total"] == sum(parts[k] for k in PARTS)


@pytest.mark.slow
def test_validate_refuses_a_recipe_that_cannot_fit_and_prints_the_estimate():
    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent `rl validate`s, side by side
        proc, ok = pool.map(lambda sets: subprocess.run([*CLI, "validate", "configs/quickstart.yaml", *sets],
                                                        capture_output=True, text=True, timeout=120),
                            [["--set", "run.device_memory_gib=0.01"], []])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("rl validate: the cpu worker needs at least 0.92 GiB per worker (") and "0.01 GiB of run.device_memory_gib" in lines[0]
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("memory: 0.92 GiB per worker (weights")


def test_fsdp2_shards_the_trainer_and_the_engine_keeps_full_weights():
    one = estimate(load_recipe("configs/quickstart.yaml", []))
    two = estimate(load_recipe("configs/quickstart.yaml", ["runtime.num_workers=2", "runtime.parallel=fsdp2"]))
    assert [two[k] for k in ("weights", "gradients", "adamw")] == [one[k] / 2 for k in ("weights", "gradients", "adamw")]
    assert two["engine_weights"] == 4 * two["parameters"] and one["engine_weights"] == 0


def test_the_estimate_counts_a_kv_pool_sized_by_a_fraction_of_free_memory():
    """engine.kv_memory_fraction f: the pool is f of the device's memory less what is there before the engine
    (the weights, here; float32, no reference, no teachers)."""
    from rl.runtime.memory import device_capacity

    recipe = load_recipe("configs/quickstart.yaml", ["engine.kv_memory_fraction=0.1"])
    parts, (capacity, _) = estimate(recipe), device_capacity(recipe)
    assert parts["kv_pool"] == pytest.approx(0.1 * (capacity - parts["weights"]))


def test_validate_counts_a_shape_only_model_without_initialising_it():
    """The meta-device model's parameters are counted without drawing their values: torch.nn.init is as it was
    afterwards, and `rl validate` never imports torch._dynamo (drawing values on meta tensors does, ~1.5 s of
    every validate on this machine)."""
    import torch

    before = torch.nn.init.normal_, torch.nn.init.kaiming_uniform_
    estimate(load_recipe("configs/quickstart.yaml", []))
    assert (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_) == before
    code = ("import sys; from rl.cli import main; rc = main(['validate', 'configs/tiny_grpo.yaml']); "
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo', rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-1] == "no dynamo 0", proc.stderr[-2000:]


@pytest.mark.parametrize("variant", [dict(moe=False, qk_norm=False), dict(moe=False, qk_norm=True), dict(moe=True)])
def test_the_activation_estimate_is_what_autograd_keeps_per_token(variant):
    """rl/runtime/memory.py `activation_bytes_per_token` (float32, without the backward's transient buffers) against
    the bytes of the tensors autograd saves for the backward, measured with saved-tensor hooks: the growth per token
    between two lengths (parameters and other fixed costs cancel), within 15% (MoE: which experts a token takes
    varies, and the estimate counts the top-k copies a token can need)."""
    import torch

    from tests.conftest import debug_config

    cfg = debug_config(**variant)
    torch.manual_seed(0)
    model = Decoder(cfg).float()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(n: int) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.forward_hidden(torch.randint(0, cfg.vocab_size, (1, n)))
        return sum(seen.values())

    measured = (saved(192) - saved(64)) / 128
    estimated = activation_bytes_per_token(cfg, autocast=False, backward=False)
    assert estimated == pytest.approx(measured, rel=0.15), (estimated, measured)


def test_validate_says_how_many_samples_the_kv_pool_holds_and_warns_past_it():
    """By arithmetic: the pool's tokens over max_seq_len and over engine.expected_tokens; a max_inflight above what it
    holds at the expected length is named (samples past it are parked, rollout/engine.py `_grow`)."""
    from rl.runtime.memory import check

    recipe = load_recipe("configs/quickstart.yaml", ["engine.num_blocks=100", "engine.expected_tokens=64"])
    e = recipe.engine
    tokens = 100 * e.block_size
    line = check(recipe)
    assert f"KV pool {tokens:,} tokens: {tokens // e.max_seq_len:,} samples at max_seq_len {e.max_seq_len}, " \
           f"{tokens // 64:,} at engine.expected_tokens 64" in line
    inflight = max(s.dispatch.max_inflight for s in recipe.stages if s.type == "grpo")
    assert ("warning: dispatch.max_inflight" in line) == (inflight > tokens // 64)
    over = load_recipe("configs/quickstart.yaml", ["engine.num_blocks=100", f"engine.expected_tokens={e.max_seq_len}"])
    assert tokens // e.max_seq_len < inflight  # (so that this one warns)
    assert f"warning: dispatch.max_inflight {inflight} is more than that" in check(over)


def test_validate_refuses_a_kv_budget_smaller_than_one_sequence():
    from rl.recipe_io import RecipeError
    from rl.runtime.memory import check

    with pytest.raises(ValueError, match=r"engine.kv_gib=0.0001 holds 48 tokens of bf16 KV .* max_seq_len=160"):
        check(load_recipe("configs/quickstart.yaml", ["engine.kv_gib=0.0001"]))
    with pytest.raises(RecipeError, match="expected_tokens=1000 is more than max_seq_len=160"):
        load_recipe("configs/quickstart.yaml", ["engine.expected_tokens=1000"])
