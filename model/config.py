"""Model-core configuration: pure pydantic, no torch, so recipes validate instantly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from configbase import StrictConfig
from model.tokenizer import CharTokenizer, Tokenizer


class CharTokenizerConfig(StrictConfig):
    """The character-level tokenizer of the synthetic tasks: 99 ids (model/tokenizer.py)."""

    type: Literal["char"] = "char"
    """Discriminator: the char tokenizer."""
    vocab_size: int | None = Field(None, ge=99)
    """Pad the ids to this many (the ids past the 99 decode to nothing): a synthetic task at a real model's output-head
    size (the benches' Qwen3 shapes, vocabulary 151,936); None: 99."""

    def build(self) -> Tokenizer:
        return CharTokenizer(self.vocab_size)


class HFTokenizerConfig(StrictConfig):
    """A Hugging Face tokenizer (model/hf_tokenizer.py): a local directory with tokenizer.json, or the tokenizer
    embedded in a .gguf file; eos/bos/pad ids and the chat template come from the checkpoint."""

    type: Literal["hf"] = "hf"
    """Discriminator: a Hugging Face tokenizer."""
    path: str | None = None
    """A tokenizer directory, a .gguf file, or the name of a model `rl models fetch` knows (its file);
    null: the tokenizer of `model.init` (the recipe fills it in)."""

    def build(self) -> Tokenizer:
        from model.hf_tokenizer import load_hf_tokenizer  # tokenizers/jinja2: only when an hf tokenizer is used
        from model.registry import resolve_model_source

        if self.path is None:
            raise ValueError("tokenizer.path is null and no model.init names the checkpoint to take the tokenizer from")
        return load_hf_tokenizer(resolve_model_source(self.path))


TokenizerConfig = Annotated[Union[CharTokenizerConfig, HFTokenizerConfig], Field(discriminator="type")]
"""A recipe's `tokenizer:`, chosen by `type`: `char` (the synthetic tasks') or `hf` (a real checkpoint's)."""


class DenseFFNConfig(StrictConfig):
    """SwiGLU feed-forward block (Llama / Qwen3 `mlp.{gate,up,down}_proj`)."""

    type: Literal["dense"] = "dense"
    """Discriminator: a dense SwiGLU FFN."""
    intermediate_size: int = Field(512, gt=0)
    """Hidden width of the SwiGLU block."""


class MoEFFNConfig(StrictConfig):
    """Mixture-of-experts FFN (Qwen3-MoE / DeepSeekMoE): shared experts plus top-k routed experts."""

    type: Literal["moe"] = "moe"
    """Discriminator: a mixture-of-experts FFN."""
    num_experts: int = Field(4, ge=1)
    """Number of routed experts."""
    num_experts_per_tok: int = Field(2, ge=1)
    """Routed experts chosen per token (top-k)."""
    moe_intermediate_size: int = Field(128, gt=0)
    """Hidden width of each routed expert's SwiGLU block."""
    num_shared_experts: int = Field(1, ge=0)
    """Always-active shared experts (DeepSeekMoE); their width is moe_intermediate_size each."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' gate weights to sum to 1 (Qwen3-MoE default)."""

    @model_validator(mode="after")
    def _k_le_experts(self) -> "MoEFFNConfig":
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        return self


FFNConfig = Annotated[Union[DenseFFNConfig, MoEFFNConfig], Field(discriminator="type")]

KVCacheDType = Literal["bf16", "fp8", "fp4"]


class KVCacheConfig(StrictConfig):
    """Storage format of the attention KV cache (seed §2.4.4) and quantisation-aware training.

    `bf16` is the unquantised cache: K/V kept in the model's parameter dtype (bf16 on the GPU, float32
    in CPU tests), today's behaviour. `fp8`: E4M3 values with one power-of-two scale per row (one token
    of one KV head; `model.fp8`), the SWA format. `fp4`: E2M1 values with one E4M3 scale per 16 channels,
    two values per byte (`model.fp4`), the main-KV format. Quantisation happens after RoPE. In the
    dense decoder there is one KV per layer and it takes this format; with CSA2 the format applies to
    the compressed main KV entries (seed §2.4.4)."""

    dtype: KVCacheDType = "bf16"
    """Storage format: bf16 (unquantised, the model's dtype), fp8 (E4M3 + per-row scale) or fp4."""
    qat: bool = False
    """Training forward passes K/V through the cache's quantise->dequantise (straight-through gradient),
    bit-identical to the engine's round trip, so the trained policy is the sampled one. No-op for bf16."""


class LinearRopeScaling(StrictConfig):
    """Linear ("position interpolation") RoPE scaling: every inverse frequency divided by `factor`."""

    type: Literal["linear"] = "linear"
    """Discriminator: linear scaling (HF `rope_scaling.type` / `rope_type` "linear")."""
    factor: float = Field(gt=0)
    """Positions are squeezed by this factor."""


class Llama3RopeScaling(StrictConfig):
    """Llama 3.1 RoPE scaling (`model.decoder.rope_inv_freq`): frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor are kept, and those between are interpolated."""

    type: Literal["llama3"] = "llama3"
    """Discriminator: Llama 3.x scaling (HF `rope_type` "llama3")."""
    factor: float = Field(gt=0)
    """Divisor of the low frequencies (8 in Llama 3.1)."""
    low_freq_factor: float = Field(gt=0)
    """Wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled (1 in Llama 3.1)."""
    high_freq_factor: float = Field(gt=0)
    """Wavelengths below original_max_position_embeddings / high_freq_factor are unscaled (4 in Llama 3.1)."""
    original_max_position_embeddings: int = Field(gt=0)
    """Context length of pre-training before the extension (8192 in Llama 3.1)."""

    @model_validator(mode="after")
    def _bands(self) -> "Llama3RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope_scaling: high_freq_factor={self.high_freq_factor} must exceed low_freq_factor={self.low_freq_factor}")
        return self


RopeScalingConfig = Annotated[Union[LinearRopeScaling, Llama3RopeScaling], Field(discriminator="type")]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(StrictConfig):
    """Low-rank adapters (LoRA, Hu et al. 2021; PEFT's layout): each targeted linear layer computes
    W x + (alpha / rank) · B A x, with A [rank, in] and B [out, rank] trained and W frozen (model/lora.py). MoE routed
    experts (stacked tensors, not linear layers) stay frozen; a shared expert's projections are adapted."""

    rank: int = Field(32, gt=0)
    """r: the adapters' inner width."""
    alpha: float = Field(32.0, gt=0)
    """The update's scale is alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (PEFT's `lora_dropout`)."""
    targets: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """The linear layers adapted, by name in every decoder layer (PEFT's `target_modules`)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initialisation (B starts at zero either way, so training starts from the base): `kaiming` uniform as
    PEFT's default, `gaussian` N(0, 1/rank) as PEFT's `init_lora_weights="gaussian"`."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class ModelConfig(StrictConfig):
    """Decoder shape. Dense form maps onto Llama/Qwen2/Qwen3, MoE form onto Qwen3-MoE/DeepSeekMoE.

    `init` names a pretrained checkpoint: a Hugging Face directory (config.json + safetensors), a GGUF
    file, or an asyncrl checkpoint directory (`model.formats.checkpoint_kind` tells them apart). Every
    architecture field is then derived from the checkpoint (`model.formats.checkpoint_fields`); a field the
    recipe gives as well must equal the derived value, else validation fails with one line naming the field
    and both values. Free to differ: `kv_cache` (storage format, QAT), `init_std` (unused), `lora` (adapters on the
    checkpoint's weights), and
    `max_position_embeddings` and `num_layers`, which may be lowered (never raised): a lower `num_layers` keeps the
    checkpoint's first layers and drops the rest (layer dropping: a smaller model of another shape initialised from
    a pretrained one, e.g. an OPD teacher of another architecture, issue #43). `sparse_attention` must match the
    checkpoint (None for Hugging Face and GGUF checkpoints: their attention is dense)."""

    vocab_size: int = Field(99, gt=0)
    """Vocabulary size; must equal the tokenizer's (the char tokenizer has 99 ids)."""
    hidden_size: int = Field(128, gt=0)
    """Residual stream width."""
    num_layers: int = Field(4, gt=0)
    """Number of decoder layers."""
    num_heads: int = Field(4, gt=0)
    """Query heads per layer."""
    num_kv_heads: int = Field(2, gt=0)
    """Key/value heads per layer (GQA); must divide num_heads."""
    head_dim: int = Field(32, gt=0)
    """Width of one attention head; must be even (RoPE rotates pairs)."""
    qk_norm: bool = True
    """RMSNorm on each head's query and key before RoPE (Qwen3)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    rms_norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of every RMSNorm."""
    max_position_embeddings: int = Field(512, gt=0)
    """Longest sequence (prompt + response) the model is used at."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    ffn: FFNConfig = Field(default_factory=MoEFFNConfig)
    """Feed-forward block of every layer: `type: dense` or `type: moe`."""
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    """KV-cache storage format (bf16 | fp8 | fp4) and QAT; default: unquantised, no QAT."""
    sparse_attention: "SparseAttentionConfig | None" = None
    """CSA2 sparse attention in every layer (seed §2.3); None = dense GQA attention."""
    attention_bias: bool = False
    """Bias on the q/k/v projections (Qwen2); the output projection never has one."""
    rope_scaling: RopeScalingConfig | None = None
    """RoPE frequency scaling, `type: linear | llama3` as Hugging Face configs spell it; None = plain RoPE."""
    hidden_act: Literal["silu"] = "silu"
    """Activation of every SwiGLU block; silu is the only one (Llama, Qwen2, Qwen3, Qwen3-MoE)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters on a frozen base instead of every weight (model/lora.py); None: full fine-tuning.
    A LoRA run's checkpoints hold the adapters and the base's identity when the base is a file (model/checkpoint.py
    `BASE_FILE`), else every weight; read as a model elsewhere (`rl eval --checkpoint`,
    `rl export`, `rl merge`, an OPD teacher) they are the merged weights W + (alpha / rank) · B A."""
    init: str | None = None
    """Pretrained checkpoint to start from (HF directory, GGUF file, asyncrl checkpoint directory, or the
    name of a model `rl models fetch` knows); its config fixes the architecture fields (see the class
    docstring). None: random initialisation."""

    @model_validator(mode="before")
    @classmethod
    def _derive_from_init(cls, data):
        if not isinstance(data, dict) or data.get("init") is None:
            return data
        from model.formats import checkpoint_fields  # torch-free: config.json / GGUF header only
        from model.registry import resolve_model_source  # `init: smollm2-135m-instruct`: the fetched file

        return merge_checkpoint_fields(cls, data, checkpoint_fields(str(resolve_model_source(data["init"]))))

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.kv_cache.dtype == "fp4" and self.head_dim % 16:
            raise ValueError(f"kv_cache.dtype=fp4 needs head_dim a multiple of 16 (one E4M3 scale per 16 channels); got {self.head_dim}")
        if self.is_sparse and (self.attention_bias or self.rope_scaling is not None):
            raise ValueError("sparse_attention (CSA2) layers take neither attention_bias nor rope_scaling")
        return self

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoEFFNConfig)

    @property
    def is_sparse(self) -> bool:
        return self.sparse_attention is not None


CSA2Mode = Literal["full", "reindex", "reuse"]


class HierarchicalIndexerConfig(StrictConfig):
    """Hierarchical Sparse Indexer (seed §2.3.2): the first Full layer at or after `from_layer` builds a
    per-query candidate pool from its top-scoring blocks; later Reindex layers score only that pool."""

    from_layer: int = Field(0, ge=0)
    """First layer index where the hierarchy applies (the decoder's first layer under CED)."""
    block_size: int = Field(8, gt=0)
    """Compressed main KV entries per block; a block's score is the max index score of its entries."""
    num_blocks: int = Field(64, gt=0)
    """Blocks kept per query; the candidate pool holds num_blocks * block_size entries."""

    @property
    def pool_size(self) -> int:
        return self.num_blocks * self.block_size


class SparseAttentionConfig(StrictConfig):
    """CSA2 sparse attention (seed §2.3): compressed main KV, lightweight indexer, top-k plus sliding
    window, per-layer Full / Reindex / Reuse modes (seed §2.3.1)."""

    compress_ratio: int = Field(4, ge=1)
    """m: consecutive tokens pooled into one main KV entry (non-overlapping); 1 = uncompressed."""
    topk: int = Field(64, gt=0)
    """Compressed main KV entries each query attends to (chosen by the indexer)."""
    window: int = Field(64, gt=0)
    """Sliding window: the query attends to this many most recent raw tokens, itself included."""
    index_heads: int = Field(4, gt=0)
    """Indexer query heads h, each with a per-token weight w_h."""
    index_dim: int = Field(32, gt=0)
    """Width of indexer Q heads and of indexer K; even (RoPE)."""
    layer_modes: tuple[CSA2Mode, ...] = ("full", "reindex", "reuse")
    """Mode pattern, repeated over the layers (layer i gets layer_modes[i % len]); starts with full."""
    hierarchical: HierarchicalIndexerConfig | None = None
    """Hierarchical Sparse Indexer; None = every indexer scores every visible entry (flat)."""
    aux_loss_weight: float = Field(0.01, ge=0)
    """Weight of the indexer KL loss (seed §3.1.2 / DeepSeek-V3.2) added to the training loss."""

    @model_validator(mode="after")
    def _rules(self) -> "SparseAttentionConfig":
        if not self.layer_modes or self.layer_modes[0] != "full":
            raise ValueError(f"layer_modes must start with 'full' (Reindex/Reuse need a main KV): {self.layer_modes}")
        if self.index_dim % 2:
            raise ValueError(f"index_dim={self.index_dim} must be even for RoPE")
        if self.hierarchical is not None and self.hierarchical.pool_size < self.topk:
            raise ValueError(
                f"candidate pool num_blocks*block_size={self.hierarchical.pool_size} is smaller than topk={self.topk}"
            )
        return self

    def mode_of(self, layer_idx: int) -> CSA2Mode:
        return self.layer_modes[layer_idx % len(self.layer_modes)]


ModelConfig.model_rebuild()


def merge_checkpoint_fields(cls: type[ModelConfig], data: dict, derived: dict) -> dict:
    """The recipe's `model:` section `data` completed by the fields `derived` from its `init` checkpoint;
    ValueError (one line, naming the field and both values) where the two disagree."""
    given = {k: v for k, v in data.items() if k != "init"}
    if isinstance(given.get("ffn"), StrictConfig):  # built in Python: compare only what was set
        ffn = given["ffn"]
        given["ffn"] = {"type": ffn.type, **ffn.model_dump(exclude_unset=True)}
    want = cls.model_validate(derived)
    merged = {**derived, **given}
    if isinstance(given.get("ffn"), dict) and given["ffn"].get("type", derived["ffn"]["type"]) == derived["ffn"]["type"]:
        merged["ffn"] = {**derived["ffn"], **given["ffn"]}
    got = cls.model_validate(merged)
    init = data["init"]
    for name in given:
        if name in ("kv_cache", "init_std", "lora"):  # free: how K/V are stored; the init of weights that get loaded;
            # adapters trained on the checkpoint's weights
            continue
        if name in ("max_position_embeddings", "num_layers"):  # may be lowered: num_layers keeps the first N layers
            if getattr(got, name) > getattr(want, name):
                raise ValueError(f"{name}={getattr(got, name)} exceeds the {getattr(want, name)} of init {init!r} "
                                 "(it may be lowered, not raised)")
            continue
        pairs = [(name, getattr(want, name), getattr(got, name))]
        if name == "ffn" and want.ffn.type == got.ffn.type:
            pairs = [(f"ffn.{k}", getattr(want.ffn, k), getattr(got.ffn, k)) for k in given["ffn"] if k != "type"]
        for field, theirs, ours in pairs:
            if theirs != ours:
                show = (lambda v: v.model_dump(mode="json") if isinstance(v, StrictConfig) else v)
                raise ValueError(f"init {init!r} has {field}={show(theirs)!r} but the recipe says {field}={show(ours)!r}")
    return {**got.model_dump(), "init": init}


def same_weights(a: ModelConfig, b: ModelConfig) -> bool:
    """Configs whose weights are interchangeable: equal up to the KV-cache storage format and QAT,
    which change how K/V are stored, not which parameters exist (a QAT fine-tune starts from a bf16
    checkpoint), up to `init` and `init_std` (where the weights came from, how random ones are drawn), and up to
    `max_position_embeddings`, the longest sequence a recipe runs (RoPE has no parameters; its scaling reads
    `rope_scaling.original_max_position_embeddings`): runs of one model at different lengths share weights."""
    return not weight_differences(a, b)


_NOT_WEIGHTS = ("kv_cache", "init", "init_std", "max_position_embeddings", "lora")
"""`lora`: adapters are tensors beside the weights, not other weights: a LoRA model starts from a base's weights (its
adapters at their initialisation), and a LoRA checkpoint read as a plain model is its merged weights (model/lora.py
`merge_lora_state`); the readers check the tensors themselves."""


def weight_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """The fields that make `a`'s weights differ from `b`'s (empty: `same_weights`), for one-line refusals."""
    return [k for k in type(a).model_fields if k not in _NOT_WEIGHTS and getattr(a, k) != getattr(b, k)]


def read_teacher_config(checkpoint: str | Path) -> ModelConfig:
    """The architecture of a teacher checkpoint, without loading any weights: an asyncrl checkpoint
    directory (its config.json as saved), or anything `init` takes (a Hugging Face directory, a GGUF file,
    the name of a fetched model), whose config is derived from it with `init` set to it."""
    from model.formats import checkpoint_kind
    from model.registry import resolve_model_source

    path = resolve_model_source(checkpoint)
    if checkpoint_kind(path) == "asyncrl":
        return ModelConfig.model_validate_json((path / "config.json").read_text())
    return ModelConfig.model_validate({"init": str(path)})


def check_vocab(student_vocab: int, teacher_cfg: ModelConfig, teacher_name: str = "teacher") -> str | None:
    """One-line error naming both vocabulary sizes when they differ, else None."""
    if teacher_cfg.vocab_size == student_vocab:
        return None
    return (f"{teacher_name} has vocab_size={teacher_cfg.vocab_size} but the student has vocab_size={student_vocab}: "
            "full-vocabulary OPD needs one shared vocabulary")
