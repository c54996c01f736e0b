"""What one policy worker will hold in device memory, estimated at `rl validate` (issue #13): a recipe that
cannot fit is refused before any worker starts, with the figure.

Per worker (one device); the trainer's tensors are float32 (`build_policy`), also under run.dtype bfloat16:
    weights P·4, gradients P·4, AdamW moments 2·P·4, each ÷ N under runtime.parallel fsdp2 with N workers
    (sharded; the one layer gathered at a time is not counted), the frozen reference P·4 when a stage has
    kl_ref_coef > 0 (P: parameters, `parameter_count`: one period of layers on the meta device and
    arithmetic, exact for every architecture, nothing allocated, the same time for any number of layers);
    with `model.lora`, weights (P + A)·4 (the T weights of the adapted layers at 2 bytes, not 4, under run.dtype
    bfloat16) and gradients and moments for the A adapter parameters alone (`lora_counts`), no reference copy (the
    base with its adapters off) and always the engine's copy;
    the engine's own copy of the weights with run.dtype bfloat16 (P·2) and under fsdp2 (P·4 or P·2: the
    engine holds full weights, rl/runtime/worker.py);
    the engine's KV pool: num_blocks · block_size tokens · num_layers · the format's bytes per token per layer
    (the unquantised format in the engine's dtype); with engine.kv_memory_fraction f, f of the device's memory
    less what is allocated before the engine starts (weights, the engine's copy, the reference, the teachers)
    (model/kv_cache.py; CSA2 models keep per-sequence caches: counted at max_seq_len for each of
    max_batch_size sequences at the compressed rate);
    the OPD teacher pool's device budget (the largest of the stages');
    the training step's logits: on GRPO and SFT stages one chunk of the chunked log-prob path (model/token_logprobs.py:
    at most `default_chunk_size` rows, or the micro-batch's trained positions if fewer) × vocab_size, float32,
    three times; on OPD stages (full-vocabulary teachers) one micro-batch of trained positions (the output head runs
    on response tokens only, rl/train/objectives.py: engine.max_new_tokens per rollout; engine.max_seq_len per SFT
    demonstration or with tool turns) × vocab_size × 4 bytes, three times (the logits, their log-softmax, and the
    gradient of either; rl/train/losses.py);
    the training forward's saved activations (`activation_bytes_per_token`, issue #41): one micro-batch's tokens
    (micro_batch_tokens, or its rows × engine.max_seq_len, the longest a row can be) × the bytes autograd keeps
    per token for the backward, layer by layer.
The allocator's slack and the backward's transient buffers are not counted: the estimate is a floor. The device's memory:
the first CUDA device's total where there is one, `run.device_memory_gib` where the recipe states it (a
host without that device), else the host's RAM for CPU runs; with none of these the estimate is printed only.
"""

from __future__ import annotations

import contextlib
import os

from rl.config import PACKED_TOKENS_CUDA, GRPOStage, OPDStage, Recipe, SFTStage

GIB = 2**30
PARTS = ("weights", "gradients", "adamw", "reference", "engine_weights", "kv_pool", "teachers", "logits", "activations")


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
        per_token = kv_bytes_per_token(recipe)
        kv = e.pool_blocks * e.block_size * per_token
        if e.kv_gib is not None:  # whole blocks of that many GiB (rollout/engine.py)
            kv = (e.kv_gib * GIB // (e.block_size * per_token)) * e.block_size * per_token
    reference = any(isinstance(s, GRPOStage) and s.kl_ref_coef > 0 for s in recipe.stages)
    teachers = max((s.teachers.device_memory_mib * 2**20 for s in recipe.stages if isinstance(s, OPDStage)), default=0.0)
    adapters, adapted = lora_counts(m)  # LoRA: only the adapters have gradients and AdamW moments
    copy = recipe.run.dtype != "float32" or shards > 1 or m.lora is not None  # LoRA: the engine decodes a merged copy
    engine_weights = params * engine_dtype.itemsize if copy else 0.0
    reference = reference and m.lora is None  # LoRA: the base with its adapters off, no second copy
    if e.kv_memory_fraction is not None and not m.is_sparse:
        capacity, _ = device_capacity(recipe)
        if capacity is not None:  # the share of what is free when the engine starts
            before = params * elem / shards + engine_weights + (params * elem if reference else 0.0) + teachers
            kv = e.kv_memory_fraction * max(capacity - before, 0.0)
    logits = max(3 * _logit_rows(recipe, s) * m.vocab_size * 4 for s in recipe.stages)
    autocast = recipe.run.dtype == "bfloat16"
    activations = max(_micro_batch_tokens(recipe, s) * activation_bytes_per_token(
        m, autocast, getattr(s, "activation_checkpointing", False)) for s in recipe.stages)
    trainer = (params + adapters) * elem / shards
    if m.lora is not None and recipe.run.dtype == "bfloat16":  # the adapted layers' frozen weights in bf16 (worker.py)
        trainer -= adapted * 2 / shards
    trained = (adapters if m.lora is not None else params) * elem / shards
    parts = {"weights": trainer, "gradients": trained, "adamw": 2 * trained,
             "reference": params * elem if reference else 0.0,
             "engine_weights": engine_weights,
             "kv_pool": float(kv), "teachers": float(teachers),
             "logits": float(logits), "activations": float(activations)}
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


def lora_parameter_count(cfg) -> int:
    """The adapters' parameters under `cfg.lora` (0 without): rank × (in + out) for each targeted linear layer of each
    decoder layer (model/lora.py), from one layer on the meta device."""
    return lora_counts(cfg)[0]


def lora_counts(cfg) -> tuple[int, int]:
    """(the adapters' parameters, the adapted layers' weights: the base a bf16 run stores in bf16); (0, 0) without."""
    if cfg.lora is None:
        return 0, 0
    import torch
    from torch import nn

    from model.decoder import Decoder

    period = len(cfg.sparse_attention.layer_modes) if cfg.is_sparse else 1
    built = min(period, cfg.num_layers)
    with torch.device("meta"), _shapes_only():
        small = Decoder(cfg.model_copy(update={"num_layers": built, "lora": None}))
    targets = set(cfg.lora.targets)
    adapted = [[m for name, m in layer.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets]
               for layer in small.model.layers]
    full, rest = divmod(cfg.num_layers, built)

    def total(per_layer: list[int]) -> int:
        return full * sum(per_layer) + sum(per_layer[:rest])

    return (total([sum(cfg.lora.rank * (m.in_features + m.out_features) for m in ms) for ms in adapted]),
            total([sum(m.in_features * m.out_features for m in ms) for ms in adapted]))


def activation_bytes_per_token(m, autocast: bool, checkpointing: bool = False, backward: bool = True) -> float:
    """Bytes the training forward keeps per token for its backward (model/decoder.py's eager path; seed-independent
    arithmetic), summed over the layers, plus the embedding and final norm. Per dense layer, with hidden d, q width
    Q = heads·head_dim, KV width K = kv_heads·head_dim, FFN width f, and under bf16 autocast (float32 alone: every
    tensor 4 bytes and no casts):
      each RMSNorm keeps its float32 input and normalised input (8d), and each matmul that reads it a bf16 cast of
      its output (autocast casts per call: q, k, v 3·2d; gate, up 2·2d), with the residual stream in float32: 26d;
      attention keeps RoPE'd q, k and v (2Q + 4K) and its output (2Q); qk-norm adds its float32 input and
      normalised input for q and k (8Q + 8K);
      the SwiGLU keeps gate, up, silu(gate) and their product: 8f (MoE: per routed expert and token, 8·f_e·top_k,
      the tokens' copies gathered per expert 2d·top_k, the router's float32 scores 4E, and the shared experts').
    With activation checkpointing a layer keeps only its float32 input (4d) and one layer's full set is rebuilt at a
    time. Plus (`backward`) one layer's backward at a time (twice a layer's set: the gradients of its activations). Against
    bench/train_step.py's peaks on an H200 (bf16 autocast, packed, 2026-12-04; the peak less weights, gradients and
    AdamW): Qwen3-0.6B shape 2.66 MiB a token here, 2.47 measured (eager, 32K tokens); 1.7B 4.12 here, 4.5 measured
    (eager, 16K; the rest: autocast's bf16 weight copies, GQA's K/V repeated on torch 2.11), 2.6 with run.compile
    layers (inductor keeps fewer); checkpointed 0.65 here, 0.82 measured (compiled). CSA2 layers are counted as dense attention (their compressed entries and
    indexer keys are per-token too, not counted)."""
    d, q, k = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    b16, cast = (2, 1) if autocast else (4, 0)
    norms = 2 * (8 * d)  # input and post-attention norms: float32 input and normalised input each
    casts = cast * 5 * b16 * d  # q, k, v, gate, up: each matmul's own cast of the norm's output
    if not autocast:
        norms += 2 * 4 * d  # float32: the norm's output itself is the matmuls' saved input
    attention = b16 * (2 * q + 2 * k) + b16 * q + 4 * m.num_heads  # q, k, v after RoPE; the output; log-sum-exp
    if m.qk_norm:
        attention += 8 * (q + k)
    ffn = m.ffn
    if getattr(ffn, "type", "dense") == "moe":
        f_e, top = ffn.moe_intermediate_size, ffn.num_experts_per_tok
        mlp = 4 * b16 * f_e * top + b16 * d * top + 4 * ffn.num_experts
        if getattr(ffn, "num_shared_experts", 0):
            mlp += 4 * b16 * ffn.num_shared_experts * f_e
    else:
        mlp = 4 * b16 * ffn.intermediate_size
    layer = norms + casts + attention + mlp  # (the residual stream is each norm's float32 input)
    ends = 4 * d + 8 * d + 8 * m.head_dim  # the embedding's output, the final norm, RoPE's cos and sin
    transient = 2 * layer if backward else 0  # one layer's backward at a time: the gradients of its activations
    if checkpointing:
        return m.num_layers * 4 * d + (layer if backward else 0) + transient + ends  # (+ the one layer rebuilt)
    return m.num_layers * layer + transient + ends


def _micro_batch_tokens(recipe: Recipe, stage) -> int:
    """Tokens (prompt and response) of one micro-batch's forward: micro_batch_tokens where set, else its rows × the
    longest a row can be (engine.max_seq_len), or on CUDA with packing by default (neither field set) the packed
    budget rl/train/trainer.py uses there."""
    if stage.micro_batch_tokens is not None:
        return stage.micro_batch_tokens
    if recipe.run.device == "cuda" and not isinstance(stage, OPDStage) and stage.packing != "padded" and \
            not {"micro_batch_size", "micro_batch_tokens"} & stage.model_fields_set:
        return PACKED_TOKENS_CUDA
    rows = stage.micro_batch_size or getattr(stage, "batch_size", 1)
    return rows * recipe.engine.max_seq_len


def _logit_rows(recipe: Recipe, stage) -> int:
    """Rows of [rows, vocab] float32 logits the loss holds at once: OPD's trained positions (full-vocabulary
    teachers), else one chunk of model/token_logprobs.py's path."""
    from model.token_logprobs import DEFAULT_CHUNK_BYTES

    positions = _trained_positions(recipe, stage)
    if isinstance(stage, OPDStage):
        return positions
    return min(positions, max(64, DEFAULT_CHUNK_BYTES // (4 * recipe.model.vocab_size)))


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


TOKEN_CAP_MARGIN = 1.25
"""`token_cap` sizes micro-batches for this many times `activation_bytes_per_token` (the estimate is within about 20%
of the measured peaks either way)."""


def token_cap(free_bytes: float, parameters: int, per_token: float, optimizer_allocated: bool) -> int:
    """Tokens one training micro-batch may hold on a device with `free_bytes` left (after the engine's KV pool and the
    weights): less the float32 gradients (allocated in the backward), the AdamW moments when not yet allocated, and
    1 GiB of slack, over `TOKEN_CAP_MARGIN` × `per_token`. At least 1: a row longer than that still trains alone."""
    left = free_bytes - 4 * parameters - (0 if optimizer_allocated else 8 * parameters) - GIB
    return max(1, int(left / (TOKEN_CAP_MARGIN * per_token)))


def kv_bytes_per_token(recipe: Recipe) -> float:
    """Bytes one token's KV takes in the engine's pool, every layer (the cache's storage format; the unquantised
    one in the engine's dtype). Dense paged models."""
    import torch

    from model.kv_cache import kv_format

    m = recipe.model
    return m.num_layers * kv_format(m.kv_cache.dtype).bytes_per_token_per_layer(m.num_kv_heads, m.head_dim,
                                                                              getattr(torch, recipe.run.dtype))


def kv_concurrency(recipe: Recipe, parts: dict[str, float]) -> str:
    """How many samples the KV pool holds at max_seq_len and at `engine.expected_tokens`, by arithmetic alone, and a
    warning when a stage's `dispatch.max_inflight` is more than it holds at the expected length (at max_seq_len
    without one): past that, samples are parked (rollout/engine.py `_grow`) and wait instead of decoding."""
    m, e = recipe.model, recipe.engine
    if m.is_sparse or not parts["kv_pool"]:
        return ""
    tokens = int(parts["kv_pool"] / kv_bytes_per_token(recipe))
    at_max = tokens // e.max_seq_len
    if e.kv_gib is not None and at_max == 0:  # the engine would refuse it at start (rollout/engine.py KVPoolSizeError)
        raise ValueError(f"engine.kv_gib={e.kv_gib:g} holds {tokens} tokens of {m.kv_cache.dtype} KV at this model's "
                         f"shape, fewer than one sequence of max_seq_len={e.max_seq_len}")
    line = f"; KV pool {tokens:,} tokens: {at_max:,} samples at max_seq_len {e.max_seq_len}"
    held = at_max
    if e.expected_tokens is not None:
        held = tokens // e.expected_tokens
        line += f", {held:,} at engine.expected_tokens {e.expected_tokens}"
    inflight = max((s.dispatch.max_inflight for s in recipe.stages if isinstance(s, GRPOStage)), default=0)
    if inflight > held:
        line += (f" (warning: dispatch.max_inflight {inflight} is more than that: the rest are parked and wait for "
                 "blocks)")
    return line


def describe(parts: dict[str, float]) -> str:
    shown = ", ".join(f"{k} {parts[k] / GIB:.2f}" for k in PARTS if parts[k])
    return f"{parts['total'] / GIB:.2f} GiB per worker ({shown}; the allocator's slack not counted)"


def largest_fitting(recipe: Recipe, capacity: float) -> str:
    """The largest shape of the Qwen3 ladder (model/shapes.py) whose estimate with everything else of `recipe` (its
    rollout budget, teachers, LoRA, KV format and lengths) fits `capacity`, with the activations of one row of
    engine.max_seq_len (a CUDA trainer cuts micro-batches to what is free: `token_cap`), and with LoRA (rank 32)
    when the recipe trains every weight: a clause for `check`'s lines."""
    from model.config import LoraConfig, ModelConfig
    from model.shapes import LADDER, SHAPES

    def largest(lora) -> str | None:
        fit = None
        for name in LADDER:  # smallest first: the estimate grows with the shape
            m = ModelConfig(**SHAPES[name], lora=lora, kv_cache=recipe.model.kv_cache,
                            max_position_embeddings=recipe.model.max_position_embeddings)
            parts = estimate(recipe.model_copy(update={"model": m}))
            row = recipe.engine.max_seq_len * max(activation_bytes_per_token(
                m, recipe.run.dtype == "bfloat16", getattr(st, "activation_checkpointing", False)) for st in recipe.stages)
            if parts["total"] - parts["activations"] + row > capacity:
                break
            fit = name
        return fit

    own, lora = largest(recipe.model.lora), None if recipe.model.lora else largest(LoraConfig())
    what = f"the largest Qwen3 shape that fits so: {own or 'none'}"
    return what + (f" ({lora} with model.lora rank 32)" if lora and lora != own else "")


def _largest(recipe: Recipe, capacity: float, before: str, after: str) -> str:
    """`largest_fitting`'s clause for a GPU recipe (~1 s of meta-device estimates); nothing for a CPU one."""
    return f"{before}{largest_fitting(recipe, capacity)}{after}" if recipe.run.device == "cuda" else ""


def check(recipe: Recipe) -> str:
    """The line `rl validate` prints; ValueError (one line) when the estimate exceeds the device's memory."""
    parts = estimate(recipe)
    capacity, source = device_capacity(recipe)
    line = f"memory: {describe(parts)} on {recipe.run.device}"
    if capacity is None:
        return f"{line}; not checked ({source}){kv_concurrency(recipe, parts)}"
    if parts["total"] > capacity:
        raise ValueError(f"the {recipe.run.device} worker needs at least {describe(parts)}, more than the "
                         f"{capacity / GIB:.2f} GiB of {source}: lower engine.max_batch_size / max_seq_len / num_blocks, "
                         "micro_batch_size / micro_batch_tokens (or turn on activation_checkpointing), "
                         f"the teachers' device_memory_mib, or the model{_largest(recipe, capacity, ' (', ')')}")
    per_token = max(activation_bytes_per_token(recipe.model, recipe.run.dtype == "bfloat16",
                                               getattr(s, "activation_checkpointing", False)) for s in recipe.stages)
    fits = int((capacity - parts["total"] + parts["activations"]) / per_token)
    return (f"{line}, of {capacity / GIB:.2f} GiB ({source}); the training forward keeps ~{per_token / 2**20:.2f} MiB "
            f"a token: micro-batches of up to {fits:,} tokens fit beside the rest{kv_concurrency(recipe, parts)}"
            f"{_largest(recipe, capacity, '; ', '')}")
