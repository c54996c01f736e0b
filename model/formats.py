"""Pretrained checkpoints on disk, config side (no torch): which kind a path is, the ModelConfig fields
its config fixes, and the Hugging Face config.json that an exported model carries.

Three kinds of `ModelConfig.init` path, told apart by their files:

    gguf     a file starting with the GGUF magic (model/gguf_file.py reads its header)
    hf       a directory whose config.json has a `model_type` (transformers' save_pretrained layout):
             model.safetensors, or model.safetensors.index.json and the shards it lists
    asyncrl  a directory whose config.json is a ModelConfig (model/checkpoint.py; rl/ checkpoints too)

Hugging Face config fields, as transformers 4.x and 5.x spell them (both are read; export writes both
where they differ): `rope_theta` + `rope_scaling` {type | rope_type, ...} (4.x) or `rope_parameters`
{rope_type, rope_theta, ...} (5.x); `num_experts` (4.x) or `num_local_experts` (5.x, Qwen3-MoE);
`torch_dtype` (4.x) or `dtype` (5.x). Architectures: llama, qwen2 (q/k/v bias), qwen3 (qk-norm),
qwen3_moe (qk-norm, routed experts, no shared expert). Anything else is refused with one line.

This module returns plain dicts of ModelConfig fields (it must not import model.config, which calls it).
"""

from __future__ import annotations

from pathlib import Path

from configbase.jsonfile import loads as bounded_json
from model.gguf_file import MAGIC, SUPPORTED_TYPES, GGUFFile

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM"}
"""HF model_type -> architectures entry, for the four architectures asyncrl maps."""

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
"""GGUF general.architecture -> the HF model_type with the same math."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
"""Files of a Hugging Face tokenizer directory that an export copies along."""


class CheckpointFormatError(ValueError):
    """A pretrained checkpoint asyncrl cannot use (one line naming the file and what is wrong)."""


def checkpoint_kind(path: str | Path) -> str:
    """'gguf', 'hf' or 'asyncrl' (see the module docstring); CheckpointFormatError when none fits."""
    p = Path(path)
    if p.is_file():
        with p.open("rb") as f:
            if f.read(4) == MAGIC:
                return "gguf"
        raise CheckpointFormatError(f"{p}: a file that is not GGUF (init takes a GGUF file or a checkpoint directory)")
    if not p.is_dir():
        raise CheckpointFormatError(f"{p}: no such file or directory")
    cfg = _read_json(p / "config.json")
    if "model_type" in cfg:
        return "hf"
    if "num_layers" in cfg and "ffn" in cfg:
        return "asyncrl"
    raise CheckpointFormatError(f"{p / 'config.json'}: neither a Hugging Face config (no model_type) nor an asyncrl ModelConfig")


def _read_json(path: Path) -> dict:
    try:
        doc = bounded_json(path.read_text())  # nesting bounded (configbase/jsonfile.py)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: unreadable ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: not a JSON object")
    return doc


MAX_SAFETENSORS_HEADER = 100_000_000
"""Bytes of a safetensors header asyncrl reads (the safetensors library's own limit)."""


def check_safetensors_header(path: Path) -> None:
    """One line unless `path` starts with a safetensors header: an 8-byte little-endian length, at most
    MAX_SAFETENSORS_HEADER and within the file, then a JSON object. Read before any tensor is allocated."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= min(MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
                raise CheckpointFormatError(f"{path}: not a safetensors file (header length {size})")
            header = bounded_json(f.read(size))
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{path}: not a safetensors file ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: not a safetensors file (header is not a JSON object)")


def checkpoint_fields(path: str | Path) -> dict:
    """The ModelConfig fields (a plain dict, `init` excluded) that checkpoint `path` fixes; also checks
    that its weight files are all there (and, for GGUF, of a type asyncrl dequantises)."""
    kind = checkpoint_kind(path)
    if kind == "gguf":
        return gguf_fields(GGUFFile(path))
    p = Path(path)
    if kind == "asyncrl":
        if not (p / "model.safetensors").is_file():
            raise CheckpointFormatError(f"{p / 'model.safetensors'}: missing")
        check_safetensors_header(p / "model.safetensors")
        return {k: v for k, v in _read_json(p / "config.json").items() if k not in ("init", "kv_cache", "init_std")}
    hf_weight_files(p)
    return hf_fields(_read_json(p / "config.json"), str(p / "config.json"))


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of an HF directory, in order; one line naming what is missing."""
    single, index = directory / "model.safetensors", directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFormatError(f"{index}: no weight_map")
        files = []
        for name in dict.fromkeys(weight_map.values()):
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise CheckpointFormatError(f"{index}: bad shard name {name!r}")
            if not (directory / name).is_file():
                raise CheckpointFormatError(f"{directory / name}: missing shard (listed in {SAFETENSORS_INDEX})")
            files.append(directory / name)
        for f in files:
            check_safetensors_header(f)
        return files
    if single.is_file():
        check_safetensors_header(single)
        return [single]
    if (directory / "pytorch_model.bin").exists():
        raise CheckpointFormatError(f"{directory}: only pytorch_model.bin (a pickle); asyncrl loads safetensors only")
    raise CheckpointFormatError(f"{single}: missing (and no {SAFETENSORS_INDEX})")


# -- Hugging Face config.json -> fields ---------------------------------------------------------------------
def _rope(cfg: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling in asyncrl's spelling or None) from either transformers spelling."""
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        if any(isinstance(v, dict) for v in params.values()):
            raise CheckpointFormatError(f"{where}: per-layer-type rope_parameters are not supported")
        theta = params.get("rope_theta", theta)
        scaling = params
    if (cfg.get("partial_rotary_factor") or (scaling or {}).get("partial_rotary_factor") or 1.0) != 1.0:
        raise CheckpointFormatError(f"{where}: partial_rotary_factor (RoPE on part of each head) is not supported")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return float(theta if theta is not None else 10000.0), None
    if kind == "linear":
        return float(theta), {"type": "linear", "factor": scaling["factor"]}
    if kind == "llama3":
        return float(theta), {"type": "llama3", "factor": scaling["factor"], "low_freq_factor": scaling["low_freq_factor"],
                              "high_freq_factor": scaling["high_freq_factor"],  # transformers' fallback when absent:
                              "original_max_position_embeddings": scaling.get("original_max_position_embeddings",
                                                                              cfg["max_position_embeddings"])}
    raise CheckpointFormatError(f"{where}: rope scaling type {kind!r} is not supported (linear, llama3)")


_QWEN = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768}
HF_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048},  # kv heads, head_dim: from the heads
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128},
    "qwen3_moe": {**_QWEN, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_key_value_heads": 4,
                  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_local_experts": 128},
}
"""transformers' defaults (its 5.x config classes) of the keys a config.json may omit, per model_type; rms_norm_eps
1e-6, rope_theta 10000 and untied embeddings are every class's (tests/unit/test_hf_config_defaults.py checks them
against transformers)."""


def hf_fields(cfg: dict, where: str = "config.json") -> dict:
    """ModelConfig fields from a Hugging Face config.json (dict); an omitted key takes its transformers default."""
    arch = cfg.get("model_type")
    if arch not in HF_ARCHITECTURES:
        raise CheckpointFormatError(f"{where}: model_type {arch!r} is not supported ({', '.join(HF_ARCHITECTURES)})")
    cfg = {**HF_DEFAULTS[arch], **cfg}
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointFormatError(f"{where}: hidden_act {act!r} is not supported (silu)")
    refused = {"mlp_bias": cfg.get("mlp_bias"), "use_sliding_window": cfg.get("use_sliding_window"),
               "attention_bias": arch != "qwen2" and cfg.get("attention_bias"),  # llama/qwen3: o_proj bias too
               "mlp_only_layers": arch == "qwen3_moe" and cfg.get("mlp_only_layers"),
               "decoder_sparse_step": arch == "qwen3_moe" and cfg.get("decoder_sparse_step", 1) != 1}
    for key, bad in refused.items():
        if bad:
            raise CheckpointFormatError(f"{where}: {key}={cfg.get(key)!r} is not supported")
    try:
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg, where)
        fields = {
            "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
            "num_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "qk_norm": arch in ("qwen3", "qwen3_moe"), "attention_bias": arch == "qwen2",
            "rope_theta": theta, "rope_scaling": scaling, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "max_position_embeddings": cfg["max_position_embeddings"],
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),  # the four classes' default
            "hidden_act": "silu", "sparse_attention": None,
        }
        if arch == "qwen3_moe":
            fields["ffn"] = {"type": "moe", "num_experts": cfg.get("num_experts", cfg.get("num_local_experts")),
                             "num_experts_per_tok": cfg["num_experts_per_tok"],
                             "moe_intermediate_size": cfg["moe_intermediate_size"], "num_shared_experts": 0,
                             "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}  # Qwen3MoeConfig's default
        else:
            fields["ffn"] = {"type": "dense", "intermediate_size": cfg["intermediate_size"]}
    except KeyError as e:
        raise CheckpointFormatError(f"{where}: no {e.args[0]}") from None
    return fields


def hf_architecture(fields: dict) -> str:
    """The HF model_type whose math a ModelConfig (as a dict) has; CheckpointFormatError when none has it."""
    moe, qk, bias = fields["ffn"]["type"] == "moe", fields["qk_norm"], fields["attention_bias"]
    if fields.get("sparse_attention") is not None:
        raise CheckpointFormatError("CSA2 sparse attention has no Hugging Face architecture to export to")
    if moe:
        if not qk or bias or fields["ffn"]["num_shared_experts"]:
            raise CheckpointFormatError("an MoE model exports as qwen3_moe only: qk_norm on, no attention bias, no shared experts")
        return "qwen3_moe"
    if bias and qk:
        raise CheckpointFormatError("q/k/v bias together with qk_norm matches no supported Hugging Face architecture")
    return "qwen3" if qk else "qwen2" if bias else "llama"


def hf_config(fields: dict, *, dtype: str, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """config.json for ModelConfig `fields` (a model_dump), loadable by transformers 4.x and 5.x: the
    RoPE and dtype fields are written in both spellings (the module docstring)."""
    arch = hf_architecture(fields)
    scaling = fields.get("rope_scaling")
    hf_scaling = None if scaling is None else {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}
    doc = {
        "architectures": [HF_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": fields["vocab_size"], "hidden_size": fields["hidden_size"],
        "num_hidden_layers": fields["num_layers"], "num_attention_heads": fields["num_heads"],
        "num_key_value_heads": fields["num_kv_heads"], "head_dim": fields["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": fields["max_position_embeddings"], "rms_norm_eps": fields["rms_norm_eps"],
        "tie_word_embeddings": fields["tie_word_embeddings"], "attention_dropout": 0.0, "use_cache": True,
        "rope_theta": fields["rope_theta"], "rope_scaling": hf_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_theta"], **(hf_scaling or {})},
        "torch_dtype": dtype, "dtype": dtype, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    if arch == "llama":
        doc.update(attention_bias=False, mlp_bias=False)
    else:
        doc.update(use_sliding_window=False, sliding_window=None, max_window_layers=fields["num_layers"])
    if arch == "qwen3":
        doc["attention_bias"] = False
    if arch == "qwen3_moe":
        ffn = fields["ffn"]
        doc.update(attention_bias=False, num_experts=ffn["num_experts"], num_experts_per_tok=ffn["num_experts_per_tok"],
                   moe_intermediate_size=ffn["moe_intermediate_size"], norm_topk_prob=ffn["norm_topk_prob"],
                   intermediate_size=ffn["moe_intermediate_size"],  # width of dense layers; there are none
                   decoder_sparse_step=1, mlp_only_layers=[])
    else:
        doc["intermediate_size"] = fields["ffn"]["intermediate_size"]
    return doc


# -- GGUF header -> fields ----------------------------------------------------------------------------------
def gguf_fields(g: GGUFFile) -> dict:
    """ModelConfig fields from a GGUF header (llama.cpp's key names, `{arch}.` prefixed)."""
    where = str(g.path)
    arch = g.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointFormatError(f"{where}: GGUF architecture {arch!r} is not supported ({', '.join(GGUF_ARCHITECTURES)})")
    bad = g.unsupported()
    if bad is not None:
        raise CheckpointFormatError(f"{where}: tensor {bad.name} has quantisation type {bad.type_name}; "
                                    f"asyncrl dequantises {', '.join(SUPPORTED_TYPES)}")
    m = {k[len(arch) + 1 :]: v for k, v in g.metadata.items() if k.startswith(arch + ".")}

    def need(key: str):
        if key not in m:
            raise CheckpointFormatError(f"{where}: GGUF metadata has no {arch}.{key}")
        v = m[key]
        if isinstance(v, list):  # llama.cpp writes per-layer arrays for some models
            if len(set(v)) != 1:
                raise CheckpointFormatError(f"{where}: {arch}.{key} differs between layers; asyncrl layers are uniform")
            v = v[0]
        return v

    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = m.get("attention.key_length", hidden // heads)
    if m.get("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointFormatError(f"{where}: rope.dimension_count={m['rope.dimension_count']} != head_dim={head_dim} "
                                    "(partial RoPE is not supported)")
    if "rope_freqs.weight" in g.tensors:
        raise CheckpointFormatError(f"{where}: rope_freqs.weight (Llama 3.1 RoPE scaling as a tensor) is not supported")
    scaling = None
    kind = m.get("rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"type": "linear", "factor": m["rope.scaling.factor"]}
    elif kind != "none":
        raise CheckpointFormatError(f"{where}: rope scaling type {kind!r} is not supported (linear)")
    if "token_embd.weight" not in g.tensors:
        raise CheckpointFormatError(f"{where}: no tensor token_embd.weight")
    vocab = g.tensors["token_embd.weight"].shape[0]  # the weights' rows (a padded vocabulary included)
    fields = {
        "vocab_size": vocab, "hidden_size": hidden, "num_layers": need("block_count"), "num_heads": heads,
        "num_kv_heads": m.get("attention.head_count_kv", heads), "head_dim": head_dim,
        "qk_norm": "blk.0.attn_q_norm.weight" in g.tensors, "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "rope_theta": float(m.get("rope.freq_base", 10000.0)), "rope_scaling": scaling,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")), "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in g.tensors, "hidden_act": "silu", "sparse_attention": None,
    }
    if isinstance(fields["num_kv_heads"], list):
        fields["num_kv_heads"] = need("attention.head_count_kv")
    if arch == "qwen3moe":
        fields["ffn"] = {"type": "moe", "num_experts": need("expert_count"), "num_experts_per_tok": need("expert_used_count"),
                         "moe_intermediate_size": need("expert_feed_forward_length"), "num_shared_experts": 0,
                         # llama.cpp's qwen3moe graph always renormalises the top-k weights (norm_w = true)
                         "norm_topk_prob": bool(m.get("expert_weights_norm", True))}
    else:
        fields["ffn"] = {"type": "dense", "intermediate_size": need("feed_forward_length")}
    return fields
