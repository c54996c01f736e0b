"""Published decoder shapes, as ModelConfig fields (random weights of real architectures' sizes): the benches'
workloads, and the ladder `rl validate` names the largest fitting shape from (rl/runtime/memory.py `largest_fitting`).
Sizes from the models' Hugging Face config.json files."""

from __future__ import annotations

from model.config import DenseFFNConfig


def _qwen3(hidden: int, layers: int, heads: int, ffn: int, tied: bool) -> dict:
    return dict(vocab_size=151936, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=128,
                ffn=DenseFFNConfig(intermediate_size=ffn), qk_norm=True, tie_word_embeddings=tied, rope_theta=1e6)


SHAPES = {  # name -> ModelConfig fields
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                    ffn=DenseFFNConfig(intermediate_size=1536), tie_word_embeddings=True, rope_theta=100000.0),
    "qwen3": _qwen3(1024, 28, 16, 3072, tied=True),  # Qwen3-0.6B
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tied=False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tied=False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, tied=False),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 ffn=DenseFFNConfig(intermediate_size=128)),
}

LADDER = ("qwen3", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
"""The Qwen3 dense sizes, smallest first: 0.6B to 32B."""
