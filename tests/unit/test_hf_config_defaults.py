"""A Hugging Face config.json that omits a key gets the architecture's transformers default (issue 40, class 8: no
test pinned it). For each of the four architectures and each key asyncrl reads, the key is dropped from a complete
config and the ModelConfig fields are compared with what transformers' own config class makes of the same file
(the attention modules read `head_dim` as `getattr(config, "head_dim", hidden_size // num_attention_heads)`)."""

import warnings

import pytest

from model.formats import hf_fields

FULL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0, "tie_word_embeddings": True}
MOE = {"moe_intermediate_size": 24, "num_experts_per_tok": 2, "num_experts": 6, "norm_topk_prob": True}


def _transformers_fields(arch: str, cfg: dict) -> dict:
    """The fields asyncrl reads, as transformers' config class resolves them."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = AutoConfig.for_model(arch, **{k: v for k, v in cfg.items() if k != "model_type"})
    out = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_hidden_layers,
           "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads,
           "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_parameters["rope_theta"], "tie_word_embeddings": c.tie_word_embeddings}
    if arch == "qwen3_moe":
        out["ffn"] = {"moe_intermediate_size": c.moe_intermediate_size, "num_experts_per_tok": c.num_experts_per_tok,
                      "num_experts": c.num_local_experts, "norm_topk_prob": c.norm_topk_prob}
    else:
        out["ffn"] = {"intermediate_size": c.intermediate_size}
    return out


def _ours(fields: dict) -> dict:
    return {**{k: fields[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                      "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")},
            "ffn": {k: v for k, v in fields["ffn"].items() if k not in ("type", "num_shared_experts")}}


CASES = [(arch, key) for arch in ("llama", "qwen2", "qwen3", "qwen3_moe")
         for key in [None, *FULL, *(MOE if arch == "qwen3_moe" else ())]
         if not (arch == "qwen3_moe" and key == "intermediate_size")]  # qwen3_moe's experts size is moe_intermediate_size


@pytest.mark.parametrize("arch, omitted", CASES, ids=[f"{a}-{k or 'complete'}" for a, k in CASES])
def test_an_omitted_key_takes_the_transformers_default(arch, omitted):
    cfg = {"model_type": arch, **FULL, **(MOE if arch == "qwen3_moe" else {})}
    if arch == "qwen3_moe":
        del cfg["intermediate_size"]
    cfg.pop(omitted, None)
    assert _ours(hf_fields(dict(cfg))) == _transformers_fields(arch, cfg)
