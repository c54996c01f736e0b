"""Pretrained models: where they live, loading one into a Decoder, exporting a Decoder to Hugging Face.

    read_pretrained_config(path)        ModelConfig of an HF directory, a GGUF file or an asyncrl checkpoint
    build_decoder(cfg, device, dtype)   a Decoder; with cfg.init set, its weights come from that checkpoint
    load_pretrained_into(model, path)   stream a checkpoint's tensors into the model's own parameters (a
                                        sharded one's rows only: each FSDP2 rank reads just its shard)
    export_hf(model, out_dir, ...)      a Hugging Face directory transformers loads as is
    export_checkpoint(ckpt, out_dir)    the same from an asyncrl checkpoint directory (rl export)

Loading never builds a state dict: each file tensor is read (safetensors) or dequantised (GGUF, one tensor
at a time), mapped by the declared conversion (model/conversion.py) and copied into the parameter, which
already sits on its device in its dtype (build_decoder allocates the model there, uninitialised, with no
host float32 copy). Loading reads safetensors, JSON and GGUF only: nothing in a checkpoint runs code, and
transformers is never imported (tests/unit/test_pretrained.py blocks it and still loads and generates).
Every failure is one line naming the file: a missing shard, an unsupported quantisation type, an unknown
architecture or tensor, a shape that disagrees with the config.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from configbase.files import output_dir, publish_dir, temp_dir_for
from model.config import ModelConfig
from model.formats import (SAFETENSORS_INDEX, TOKENIZER_FILES, CheckpointFormatError, checkpoint_fields, checkpoint_kind,
                           hf_architecture, hf_config, hf_weight_files)

if TYPE_CHECKING:  # annotations only: importing this module does not import torch
    import torch

    from model.decoder import Decoder

DEFAULT_SHARD_BYTES = 5 * 2**30


def read_pretrained_config(path: str | Path) -> ModelConfig:
    """The architecture of checkpoint `path` (no weights read), with `init` set to it."""
    return ModelConfig.model_validate({**checkpoint_fields(path), "init": str(path)})


# -- loading ------------------------------------------------------------------------------------------------
def build_decoder(cfg: ModelConfig, device="cpu", dtype=None, read_weights: bool = True):
    """A Decoder of `cfg` on `device` in `dtype` (default float32). With `cfg.init` the parameters are
    allocated there uninitialised (built on the meta device: no random init, no host copy) and then
    filled from the checkpoint (unless `read_weights` is False: the caller fills them, e.g. each FSDP2 rank
    its shard once sharded); without, the usual random initialisation."""
    import torch

    from model.decoder import Decoder
    from model.lora import apply_lora
    from model.registry import resolve_model_source

    dtype = dtype or torch.float32
    if cfg.init is None:
        model = Decoder(cfg).to(device=device, dtype=dtype)
        if cfg.lora is not None:  # after the base's initialisation: the same base as a run without adapters
            apply_lora(model, cfg.lora)
        return model
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives every parameter its own storage: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    for b in model.buffers():  # Router.e_score_correction_bias: zero (no checkpoint of ours has one)
        b.zero_()
    if cfg.lora is not None:  # initialised adapters; a base checkpoint leaves them so, a LoRA one loads them too
        apply_lora(model, cfg.lora)
    if read_weights:
        load_pretrained_into(model, resolve_model_source(cfg.init))
    return model


def _open_source(path: Path, kind: str, cfg: ModelConfig):
    """(conversion, [(file, names, read(name, rows) -> tensor)] lazily) of checkpoint `path` of `kind`; `rows`
    (a range of dim 0, or None for all) is read as a safetensors slice: the file's other rows are not read.
    GGUF tensors are dequantised whole, then cut."""
    import torch
    from safetensors import SafetensorError, safe_open

    from model.conversion import gguf_conversion, hf_conversion, hf_expert_layout, identity_conversion

    if kind == "gguf":
        from model.gguf_file import GGUFFile

        g = GGUFFile(path)
        conv = gguf_conversion(cfg, g.metadata["general.architecture"])

        def dequantized(name, rows):
            t = torch.from_numpy(g.dequantized(name))
            return t if rows is None else t[rows.start : rows.stop]
        return conv, iter([(path, list(g.tensors), dequantized)])
    if kind == "asyncrl":
        from model.checkpoint import base_record, load_config

        if base_record(path) is not None:  # LoRA adapters alone (model/checkpoint.py BASE_FILE): on their base
            state = read_weights(load_config(path).model_copy(update={"lora": cfg.lora}), path)
            return identity_conversion(cfg, list(state)), iter([(path / "model.safetensors", list(state), lambda n, rows:
                                                                  state[n] if rows is None else state[n][rows.start : rows.stop])])
    files = hf_weight_files(path) if kind == "hf" else [path / "model.safetensors"]
    names = {}
    for f in files:  # headers only: every tensor name, to pick the expert layout before loading any
        try:
            with safe_open(str(f), framework="pt") as st:
                names[f] = list(st.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointFormatError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:100]})") from None
    all_names = [n for ns in names.values() for n in ns]
    conv = hf_conversion(cfg, hf_expert_layout(all_names)) if kind == "hf" else identity_conversion(cfg, all_names)

    def tensors():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                yield f, names[f], lambda n, rows: st.get_tensor(n) if rows is None else st.get_slice(n)[rows.start : rows.stop]
    return conv, tensors()


def shard_rows(name: str, t) -> range | None:
    """The dim-0 rows of parameter `t` this rank holds: all (None) unless `t` is a DTensor sharded along dim 0 over
    a one-dimensional mesh (FSDP2's `fully_shard`), whose rank r keeps chunk r of ceil(rows / ranks) rows."""
    from model.decoder import is_dtensor

    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Replicate, Shard

    if all(isinstance(p, Replicate) for p in t.placements):
        return None
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise CheckpointFormatError(f"{name}: sharded as {t.placements} over a {t.device_mesh.ndim}-D mesh; loading "
                                    "shards reads dim 0 over one mesh dimension only")
    n, ranks, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-n // ranks)
    kept = range(min(rank * chunk, n), min((rank + 1) * chunk, n))
    if len(kept) != t.to_local().shape[0]:  # torch laid the shards out otherwise: refuse rather than mix rows up
        raise CheckpointFormatError(f"{name}: rank {rank} holds {t.to_local().shape[0]} rows, expected {len(kept)}")
    return kept


LAYER_OF = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")
"""The decoder layer a tensor of a checkpoint belongs to: Hugging Face's `model.layers.{i}.`, GGUF's `blk.{i}.`,
asyncrl's `layers.{i}.`."""


def _dropped(name: str, cfg: ModelConfig) -> bool:
    """A checkpoint tensor of a layer past the config's `num_layers` (layer dropping: not read)."""
    layer = LAYER_OF.search(name)
    return layer is not None and int(layer.group(1)) >= cfg.num_layers


def load_pretrained_into(model, path: str | Path) -> int:
    """Copy checkpoint `path` (HF directory, GGUF file or asyncrl checkpoint) into `model`'s parameters
    in place, tensor by tensor, on their device and in their dtype. Every parameter must be written.

    A parameter sharded along dim 0 (a DTensor: FSDP2's `fully_shard`, rl/train/parallel.py) is filled with this
    rank's rows only, and only those rows are read from the file (`Conversion.to_ours_rows`: safetensors slices;
    experts the rank does not hold are not read at all), so each of N ranks reads about 1/N of the file (a GGUF's
    tensors are dequantised whole, then cut). Returns the bytes of tensor data read."""
    import torch

    from model.checkpoint import check_finite
    from model.config import same_weights
    from model.conversion import UnknownTensor

    path, cfg = Path(path), model.config
    kind = checkpoint_kind(path)
    if kind == "asyncrl":
        from model.checkpoint import load_config

        saved = load_config(path)
        if cfg.num_layers > saved.num_layers or not same_weights(saved.model_copy(update={"num_layers": cfg.num_layers}), cfg):
            raise CheckpointFormatError(f"{path / 'config.json'}: saved with a different model config")
    conv, sources = _open_source(path, kind, cfg)
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}  # a tied lm_head: once, as embed_tokens
    kept = {n: shard_rows(n, t) for n, t in targets.items()}
    with torch.no_grad():
        targets = {n: t.to_local() if kept[n] is not None else t for n, t in targets.items()}  # this rank's shard
    written = dict.fromkeys(targets, 0)
    seen: set[str] = set()
    nbytes = 0

    def counted(t: torch.Tensor) -> torch.Tensor:
        nonlocal nbytes
        nbytes += t.numel() * t.element_size()
        return t

    with torch.no_grad():
        if kind != "asyncrl":  # Router.e_score_correction_bias: none of these formats has one
            for name, b in model.named_buffers():
                b.zero_()
                written[name] = b.numel()
        for file, names, read in sources:
            for name in names:
                if _dropped(name, cfg):
                    continue  # layer dropping (model.num_layers below the checkpoint's): the first num_layers only
                try:
                    pieces = conv.to_ours_rows(name, lambda rows, name=name: counted(read(name, rows)), kept.get)
                except UnknownTensor:
                    raise CheckpointFormatError(f"{file}: unexpected tensor {name} for this architecture") from None
                except RuntimeError as e:  # a reshape in a step that the shape cannot take
                    raise CheckpointFormatError(f"{file}: tensor {name} does not fit the config ({str(e).splitlines()[0]})") from None
                seen.add(name)
                for piece in pieces:
                    if piece.name not in targets:
                        raise CheckpointFormatError(f"{file}: unexpected tensor {name} for this config")
                    dst = targets[piece.name].data
                    dst = dst[piece.index] if piece.index else dst
                    if tuple(dst.shape) != tuple(piece.tensor.shape):
                        raise CheckpointFormatError(f"{file}: tensor {name} has shape {tuple(piece.tensor.shape)}; "
                                                    f"the config gives {piece.name} shape {tuple(dst.shape)}")
                    if dst.is_floating_point() and not piece.tensor.is_floating_point():  # copy_ would cast it in
                        raise CheckpointFormatError(f"{file}: tensor {name} is {str(piece.tensor.dtype).removeprefix('torch.')}, "
                                                    "not floating point: not model weights")
                    dst.copy_(check_finite(piece.tensor, name, file))
                    written[piece.name] += piece.tensor.numel()
    missing = [n for n, _, _ in conv.source_names() if n not in seen and not _dropped(n, cfg)]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointFormatError(f"{path}: no tensor {missing[0]}{more}")
    # LoRA adapters (model/lora.py) that a base checkpoint does not hold keep their initialisation
    from model.lora import is_adapter

    short = [n for n, t in targets.items() if written[n] < t.numel() and not is_adapter(n)]
    if short:
        raise CheckpointFormatError(f"{path}: no tensor for {short[0]}")
    return nbytes


# -- asyncrl checkpoints as models: LoRA adapters alone are put back on their base ------------------------------------
def base_state(directory: str | Path, saved: ModelConfig, record: dict, device="cpu") -> dict[str, torch.Tensor]:
    """The full state dict of a checkpoint of adapters alone: its base's weights (checked against `record`) under its
    adapters, as a LoRA model of the saved config holds them."""
    from model.checkpoint import check_base, saved_tensors
    from model.lora import is_adapter

    path = check_base(directory, record)
    model = build_decoder(saved.model_copy(update={"init": str(path)}), device=device)
    state = model.state_dict()
    adapters = saved_tensors(Path(directory), device)
    missing = sorted(k for k in state if is_adapter(k) and k not in adapters)
    unexpected = sorted(k for k in adapters if k not in state)
    if missing or unexpected:
        raise CheckpointFormatError(f"{Path(directory) / 'model.safetensors'}: does not hold the adapters of its config "
                                    f"(missing {missing[:2]}, unexpected {unexpected[:2]})")
    state.update(adapters)
    if saved.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def read_weights(config: ModelConfig, directory: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's full state_dict, after checking it was saved with `config`'s weights; a checkpoint of LoRA
    adapters alone with its base put back (`base_state`), merged when `config` has no adapters."""
    from model.checkpoint import base_record, load_config, saved_tensors
    from model.config import same_weights

    path = Path(directory)
    saved = load_config(path)
    if not same_weights(saved, config):
        raise ValueError(f"checkpoint {path} was saved with a different model config")
    record = base_record(path)
    state = saved_tensors(path, device) if record is None else base_state(path, saved, record, device)
    if saved.lora is not None and config.lora is None:  # a LoRA run's checkpoint read as a plain model: merged
        from model.lora import merge_lora_state

        state = merge_lora_state(state, saved.lora)
    return state


def read_state(directory: str | Path, device="cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(saved config, full state dict) of an asyncrl checkpoint directory, adapters and all (what `model.lora.as_plain`
    turns into a plain model for `rl merge` and the OPD teachers)."""
    from model.checkpoint import load_config

    saved = load_config(directory)
    return saved, read_weights(saved, directory, device)


def load_weights_into(model: Decoder, directory: str | Path, base: str | Path | None = None) -> None:
    """Copy a checkpoint's weights into `model` in place (same config), keeping its device. `base`: the file `model`'s
    frozen weights were just read from (a LoRA run's resume): a checkpoint of adapters alone on that base (same
    digests, else one line) loads its adapters only, over the weights already there."""
    from model.checkpoint import base_record, check_base, load_config, saved_tensors
    from model.lora import is_adapter
    from model.config import same_weights

    device = next(model.parameters()).device
    record = base_record(directory)
    if record is not None and base is not None and model.config.lora is not None:
        check_base(directory, record, against=base)
        if not same_weights(load_config(directory), model.config):
            raise ValueError(f"checkpoint {Path(directory)} was saved with a different model config")
        state = saved_tensors(Path(directory), device)
        expected = {k for k in model.state_dict() if is_adapter(k)}
        if set(state) != expected:
            raise ValueError(f"checkpoint {Path(directory)} does not hold its config's adapters: missing "
                             f"{sorted(expected - set(state))[:3]}, unexpected {sorted(set(state) - expected)[:3]}")
        model.load_state_dict(state, strict=False)
        return
    state = read_weights(model.config, directory, device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {Path(directory)} does not match its config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Decoder:
    """The checkpoint's model; a LoRA run's as the plain model of its merged weights (model/lora.py)."""
    from model.checkpoint import load_config
    from model.decoder import Decoder

    model = Decoder(load_config(path).model_copy(update={"lora": None})).to(device)
    load_weights_into(model, path)
    return model


# -- export -------------------------------------------------------------------------------------------------
_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
TokenizerFrom = str | Path | Callable[[Path], None] | None


def export_hf(model, out_dir: str | Path, *, tokenizer_from: TokenizerFrom = None, bos_token_id: int | None = None,
              eos_token_id: int | None = None, expert_layout: str = "per_expert",
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write `model` as a Hugging Face directory at `out_dir` (which must not exist or be empty): config.json,
    model.safetensors (or shards + model.safetensors.index.json above `max_shard_bytes`),
    generation_config.json and tokenizer files. MoE experts are written per expert (save_pretrained's
    layout) unless expert_layout="fused". `tokenizer_from`: an HF directory whose tokenizer files (and
    generation_config.json) are copied, or a callable that writes them into the directory it is given
    (the tokenizer's own writer, e.g. for a GGUF source whose tokenizer lives in the GGUF header)."""
    from model.lora import as_plain  # a LoRA model: the trained policy, adapters merged

    cfg, state = as_plain(model.config, dict(model.state_dict()))
    return _write_hf(cfg, state.__getitem__, Path(out_dir), tokenizer_from, bos_token_id, eos_token_id,
                     expert_layout, max_shard_bytes)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, tokenizer_from: TokenizerFrom = None,
                      bos_token_id: int | None = None, eos_token_id: int | None = None, expert_layout: str = "per_expert",
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """`export_hf` of an asyncrl checkpoint directory (config.json + model.safetensors), read tensor by
    tensor without building a Decoder."""
    from safetensors import safe_open

    from model.checkpoint import base_record, load_config
    from model.lora import as_plain

    checkpoint = Path(checkpoint)
    cfg = load_config(checkpoint)
    if base_record(checkpoint) is not None:  # LoRA adapters alone: on their base, merged (model/checkpoint.py)
        plain, state = as_plain(*read_state(checkpoint))
        return _write_hf(plain, lambda name: state[
            "model.embed_tokens.weight" if name == "lm_head.weight" and name not in state else name], Path(out_dir),
                         tokenizer_from, bos_token_id, eos_token_id, expert_layout, max_shard_bytes)
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())

        def get(name: str):
            if name == "lm_head.weight" and name not in keys and cfg.tie_word_embeddings:
                name = "model.embed_tokens.weight"
            if name not in keys:
                raise CheckpointFormatError(f"{checkpoint / 'model.safetensors'}: no tensor {name}")
            layer = name.removesuffix(".weight")
            if cfg.lora is not None and f"{layer}.lora_A" in keys:  # a LoRA run: the merged weight (model/lora.py)
                from model.lora import merge_lora_state

                return merge_lora_state({n: st.get_tensor(n) for n in (name, f"{layer}.lora_A", f"{layer}.lora_B")},
                                        cfg.lora)[name]
            return st.get_tensor(name)

        return _write_hf(cfg.model_copy(update={"lora": None}), get, Path(out_dir), tokenizer_from, bos_token_id,
                         eos_token_id, expert_layout, max_shard_bytes)


def _write_hf(cfg: ModelConfig, get, out: Path, tokenizer_from: TokenizerFrom, bos_token_id, eos_token_id,
              expert_layout: str, max_shard_bytes: int) -> Path:
    """Everything into a fresh sibling temporary directory, renamed to `out` at the end (no half export); `out`
    must be absent or an empty directory (configbase/files.py)."""
    from model.conversion import hf_conversion

    output_dir(out, what="export directory")  # absent or empty: WriteRefused (a ValueError, one line) otherwise
    fields = cfg.model_dump(mode="json")
    hf_architecture(fields)  # refuse before writing anything
    conv = hf_conversion(cfg, expert_layout)
    if cfg.is_moe:  # Qwen3-MoE has no selection bias: refuse to drop a trained one silently
        for i in range(cfg.num_layers):
            if get(f"model.layers.{i}.mlp.gate.e_score_correction_bias").abs().max() > 0:
                raise CheckpointFormatError(f"layer {i} has a nonzero e_score_correction_bias, which qwen3_moe cannot hold")
    tmp = temp_dir_for(out)  # a fresh name: only this call's temporary directory is ever removed
    try:
        _write_files(fields, conv, get, tmp, tokenizer_from, bos_token_id, eos_token_id, max_shard_bytes)
        publish_dir(tmp, out)  # over nothing but an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_files(fields: dict, conv, get, tmp: Path, tokenizer_from, bos_token_id, eos_token_id, max_shard_bytes) -> None:
    from safetensors.torch import save_file

    shards: list[list[str]] = []  # tensor names per shard file, in order
    shard, shard_bytes, total, dtype = {}, 0, 0, None
    for name, t in conv.export(get):
        t = t.detach().to("cpu").clone()  # own storage: stacked experts' rows are views of one tensor
        dtype = dtype or _DTYPES.get(str(t.dtype), "float32")
        size = t.numel() * t.element_size()
        if shard and shard_bytes + size > max_shard_bytes:  # at most one shard in host memory
            save_file(shard, str(tmp / f"shard-{len(shards):05d}"), metadata={"format": "pt"})
            shards.append(list(shard))
            shard, shard_bytes = {}, 0
        shard[name] = t
        shard_bytes, total = shard_bytes + size, total + size
    save_file(shard, str(tmp / f"shard-{len(shards):05d}"), metadata={"format": "pt"})
    shards.append(list(shard))
    if len(shards) == 1:
        (tmp / "shard-00000").rename(tmp / "model.safetensors")
    else:  # transformers' names and index
        weight_map = {}
        for k, names in enumerate(shards):
            final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            (tmp / f"shard-{k:05d}").rename(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if callable(tokenizer_from):
        tokenizer_from(tmp)
    elif tokenizer_from is not None:
        src = Path(tokenizer_from)
        for name in TOKENIZER_FILES + ("generation_config.json",):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        if (src / "config.json").is_file():  # the source's special ids, unless given
            source_cfg = json.loads((src / "config.json").read_text())
            generation = {k: generation[k] if generation[k] is not None else source_cfg.get(k) for k in generation}
    (tmp / "config.json").write_text(json.dumps(hf_config(fields, dtype=dtype or "float32", **generation), indent=2))
    if not (tmp / "generation_config.json").is_file():
        (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2))


PEFT_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")
"""The adapted layers a PEFT adapter of a Llama/Qwen base holds: ours are named as transformers names them."""


def export_peft_adapter(checkpoint: str | Path, out_dir: str | Path, base_model: str | None = None) -> Path:
    """A LoRA run's checkpoint as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(base, DIR)` loads onto the base it was trained on (`base_model`: its path,
    recorded as base_model_name_or_path; default: the path the checkpoint's base.json names). CheckpointFormatError (one line) for a checkpoint without adapters or with
    adapters PEFT's layout of these architectures has no place for (a shared expert's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from model.checkpoint import base_record, load_config

    checkpoint, out = Path(checkpoint), Path(out_dir)
    cfg = load_config(checkpoint)
    base_model = base_model or (base_record(checkpoint) or {}).get("path")
    if cfg.lora is None:
        raise CheckpointFormatError(f"{checkpoint}: not trained with LoRA (no model.lora): export the model, not an adapter")
    output_dir(out, what="export directory")
    tensors = {}
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as st:
        for name in st.keys():
            layer, _, kind = name.rpartition(".")
            if kind in ("lora_A", "lora_B"):
                if not PEFT_LAYER.match(layer):
                    raise CheckpointFormatError(f"{checkpoint}: adapter {name} has no place in a PEFT adapter of a "
                                                f"Llama/Qwen base")
                tensors[f"base_model.model.{layer}.{kind}.weight"] = st.get_tensor(name).contiguous()
    lora = cfg.lora
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": sorted(lora.targets),
              "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False,
              "use_dora": False, "modules_to_save": None}
    tmp = temp_dir_for(out)
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
