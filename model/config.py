"""Model-core configuration: pure pydantic, no torch, so recipes validate instantly.

`StrictConfig` is the shared base of every component config in asyncrl: unknown keys are rejected,
every field carries a one-line docstring (pydantic turns it into the field description), and
instances are immutable once validated.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictConfig(BaseModel):
    """Base of all component configs: strict keys, documented fields, immutable."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


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


class ModelConfig(StrictConfig):
    """Decoder shape. Dense form maps onto Llama/Qwen3, MoE form onto Qwen3-MoE/DeepSeekMoE."""

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

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        return self

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoEFFNConfig)
