"""Teacher architectures: five families that share only the student's 99-id char vocabulary. Pure pydantic.

They differ in depth, width, attention heads, KV heads (MHA, GQA, MQA), qk-norm, tied embeddings and
FFN type (dense SwiGLU or MoE), as the OPD stage's teachers may (seed §5.2.4).
"""

from __future__ import annotations

from model.config import DenseFFNConfig, ModelConfig, MoEFFNConfig

ARCHITECTURES: dict[str, ModelConfig] = {
    "dense-deep": ModelConfig(hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
                              ffn=DenseFFNConfig(intermediate_size=128)),
    "dense-wide": ModelConfig(hidden_size=192, num_layers=2, num_heads=6, num_kv_heads=6, head_dim=32,
                              ffn=DenseFFNConfig(intermediate_size=384)),
    "moe": ModelConfig(hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24,
                       ffn=MoEFFNConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)),
    "mqa": ModelConfig(hidden_size=128, num_layers=3, num_heads=8, num_kv_heads=1, head_dim=16,
                       ffn=DenseFFNConfig(intermediate_size=256)),
    "noqk-tied": ModelConfig(hidden_size=96, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=24, qk_norm=False,
                             tie_word_embeddings=True, ffn=DenseFFNConfig(intermediate_size=192)),
}
"""Teacher architectures; all share the student's vocabulary (99 char ids) and nothing else."""


def tiny(cfg: ModelConfig) -> ModelConfig:
    """The same architecture family at debug size (width 32, 1-2 layers), for smoke tests."""
    ffn = cfg.ffn.model_copy(update={"moe_intermediate_size": 16} if cfg.is_moe else {"intermediate_size": 64})
    heads = min(cfg.num_heads, 4)
    kv = cfg.num_kv_heads if heads % cfg.num_kv_heads == 0 and cfg.num_kv_heads <= heads else heads
    return cfg.model_copy(update=dict(hidden_size=32, num_layers=min(cfg.num_layers, 2), num_heads=heads,
                                      num_kv_heads=kv, head_dim=8, ffn=ffn))
