"""What one policy worker will hold in device memory, estimated at `rl validate` (issue #13): a recipe that
cannot fit is refused before any worker starts, with the figure.

Per worker (one device); the trainer's tensors are float32 (`build_policy`), also under run.dtype bfloat16:
    weights P·4, gradients P·4, AdamW moments 2·P·4, each ÷ N under runtime.parallel fsdp2 with N workers
    (sharded; the one layer gathered at a time is not counted), the frozen reference P·4 when a stage has
    kl_ref_coef > 0 (P: parameters, `parameter_count`: one period of layers on the meta device and
    arithmetic, exact for every architecture, nothing allocated, the same time for any number of layers);
    the engine's own copy of the weights with run.dtype bfloat16 (P·2) and under fsdp2 (P·4 or P·2: the
    engine holds full weights, rl/runtime/worker.py);
    the engine's KV pool: num_blocks · block_size tokens · num_layers · the format's bytes per token per layer
    (the unquantised format in the engine's dtype); with engine.kv_memory_fraction f, f of the device's memory
    less what is allocated before the engine starts (weights, the engine's copy, the reference, the teachers)
    (model/kv_cache.py; CSA2 models keep per-sequence caches: counted at max_seq_len for each of
    max_batch_size sequences at the compressed rate);
    the OPD teacher pool's device budget (the largest of the stages');
    the training step's logits: one micro-batch (the largest of the stages'; SFT without one: its batch;
    micro_batch_tokens where set) of trained positions (the output head runs on response tokens only,
    rl/train/objectives.py: engine.max_new_tokens per rollout; engine.max_seq_len per SFT demonstration or with
    tool turns) × vocab_size, float32, three times (the logits, their log-softmax, and the gradient of
    either; rl/train/losses.py), the activation that dominates at a real vocabulary.
Other activations and the allocator's slack are not counted: the estimate is a floor. The device's memory:
the first CUDA device's total where there is one, `run.device_memory_gib` where the recipe states it (a
host without that device), else the host's RAM for CPU runs; with none of these the estimate is printed only.
"""

from __future__ import annotations

import contextlib
import os

from rl.config import GRPOStage, OPDStage, Recipe, SFTStage

GIB = 2**30
PARTS = ("weights", "gradients", "adamw", "reference", "engine_weights", "kv_pool", "teachers", "logits")


@contextlib.contextmanager
def _shapes_only():
    """Module constructors skip their weight initialisation: torch.nn.init's in-place initialisers do nothing inside
    (as transformers' `no_init_weights`; `Decoder.reset_parameters` skips meta tensors itself). A meta tensor has no
    values to draw, and drawing them anyway goes through torch's Python reference ops, whose first use imports
    torch._dynamo: ~1.5 s of every `rl validate` here."""
    import torch

    saved = {n: f for n, f in vars(torch.nn.init).items() if n.endswith("_") and not n.startswith("_") and callable(f)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.nn.init, name, f)


def estimate(recipe: Recipe) -> dict[str, float]:
    """Bytes per worker by part, and their sum under "total"."""
    import torch

    from model.kv_cache import kv_format
    from model.sparse_attention import bytes_per_token as csa2_bytes_per_token

    params = parameter_count(recipe.model)
    elem = 4  # the trainer's float32
    rt = recipe.runtime
    shards = rt.num_workers if rt.parallel == "fsdp2" and rt.num_workers > 1 else 1
    engine_dtype = getattr(torch, recipe.run.dtype)
    m, e = recipe.model, recipe.engine
    if m.is_sparse:
        kv = e.max_batch_size * e.max_seq_len * csa2_bytes_per_token(m, engine_dtype.itemsize)
    else:
        per_token = m.num_layers * kv_format(m.kv_cache.dtype).bytes_per_token_per_layer(m.num_kv_heads, m.head_dim, engine_dtype)
        kv = e.pool_blocks * e.block_size * per_token
    reference = any(isinstance(s, GRPOStage) and s.kl_ref_coef > 0 for s in recipe.stages)
    teachers = max((s.teachers.device_memory_mib * 2**20 for s in recipe.stages if isinstance(s, OPDStage)), default=0.0)
    engine_weights = params * engine_dtype.itemsize if recipe.run.dtype != "float32" or shards > 1 else 0.0
    if e.kv_memory_fraction is not None and not m.is_sparse:
        capacity, _ = device_capacity(recipe)
        if capacity is not None:  # the share of what is free when the engine starts
            before = params * elem / shards + engine_weights + (params * elem if reference else 0.0) + teachers
            kv = e.kv_memory_fraction * max(capacity - before, 0.0)
    logits = max(3 * _trained_positions(recipe, s) * m.vocab_size * 4 for s in recipe.stages)
    trainer = params * elem / shards
    parts = {"weights": trainer, "gradients": trainer, "adamw": 2 * trainer,
             "reference": params * elem if reference else 0.0,
             "engine_weights": engine_weights,
             "kv_pool": float(kv), "teachers": float(teachers),
             "logits": float(logits)}
    return {**parts, "total": sum(parts.values()), "parameters": float(params)}


def parameter_count(cfg) -> int:
    """Parameters of `Decoder(cfg)`, never building it (issue 40: validation of a 20,000-layer recipe built it in
    20 s). Layers repeat with a period (1, or CSA2's `layer_modes`: a layer's parameters depend only on its mode),
    so a meta-device Decoder with one period of layers gives the embeddings, final norm and head (its count less
    its layers') and each layer's count; the rest is arithmetic. Exact (tests/unit/test_memory_arithmetic.py)."""
    import torch

    from model.decoder import Decoder

    period = len(cfg.sparse_attention.layer_modes) if cfg.is_sparse else 1
    built = min(period, cfg.num_layers)
    with torch.device("meta"), _shapes_only():
        small = Decoder(cfg.model_copy(update={"num_layers": built}))
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in small.model.layers]
    ends = small.num_parameters() - sum(per_layer)
    full, rest = divmod(cfg.num_layers, period)
    return ends + full * sum(per_layer) + sum(per_layer[:rest]) if built == period else small.num_parameters()


def _trained_positions(recipe: Recipe, stage) -> int:
    """Positions of one micro-batch the output head runs on (rl/objectives.response_logprobs: the trained
    response tokens): micro_batch_tokens where set, else its rows × a response's most tokens (a rollout's:
    engine.max_new_tokens; with tool turns, whose outputs join the response, and for SFT demonstrations:
    engine.max_seq_len)."""
    e = recipe.engine
    if stage.micro_batch_tokens is not None:
        return stage.micro_batch_tokens
    if isinstance(stage, SFTStage):
        return (stage.micro_batch_size or stage.batch_size) * e.max_seq_len
    return stage.micro_batch_size * (e.max_seq_len if recipe.tools is not None else min(e.max_new_tokens, e.max_seq_len))


def device_capacity(recipe: Recipe) -> tuple[float | None, str]:
    """(bytes, where the figure comes from) of the memory one worker's device has; None when unknown."""
    if recipe.run.device_memory_gib is not None:
        return recipe.run.device_memory_gib * GIB, "run.device_memory_gib"
    if recipe.run.device == "cuda":
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
        return None, "no CUDA device here and no run.device_memory_gib"
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host RAM"


def describe(parts: dict[str, float]) -> str:
    shown = ", ".join(f"{k} {parts[k] / GIB:.2f}" for k in PARTS if parts[k])
    return f"{parts['total'] / GIB:.2f} GiB per worker ({shown}; other activations not counted)"


def check(recipe: Recipe) -> str:
    """The line `rl validate` prints; ValueError (one line) when the estimate exceeds the device's memory."""
    parts = estimate(recipe)
    capacity, source = device_capacity(recipe)
    line = f"memory: {describe(parts)} on {recipe.run.device}"
    if capacity is None:
        return f"{line}; not checked ({source})"
    if parts["total"] > capacity:
        raise ValueError(f"the {recipe.run.device} worker needs at least {describe(parts)}, more than the "
                         f"{capacity / GIB:.2f} GiB of {source}: lower engine.max_batch_size / max_seq_len / num_blocks, micro_batch_size, "
                         f"the teachers' device_memory_mib, or the model")
    return f"{line}, of {capacity / GIB:.2f} GiB ({source})"
