"""One declared conversion between a foreign checkpoint's tensors and asyncrl's, used both ways (STYLE §10).

A `Conversion` is a list of small steps. Each step relates the tensors a *source* name template matches
(`model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, `blk.{i}.attn_q.weight`) to asyncrl parameters,
and knows both directions:

    to_ours(fields, t)     a source tensor -> pieces written into asyncrl parameters (name, index, value)
    from_ours(fields, get) the source tensor rebuilt from asyncrl parameters (get(name) -> tensor)

so that loading streams a file tensor by tensor into the model's parameters, and exporting enumerates
every source name of the architecture (`source_names`) and rebuilds each from the model. Export is
therefore the same list run backwards, and `from_ours(to_ours(t)) == t` is what the round-trip tests check.

A rank of a sharded trainer (FSDP2: each parameter split along dim 0) loads only its rows: `to_ours_rows`
asks for just the source rows that land in them (a Rename or FuseGateUp reads the same rows of the source,
StackExperts reads only the experts the rank holds); a step whose rows mix (PermuteRoPE) reads the whole
source tensor and keeps its rows.

The steps:
    Rename          same tensor, another name (most of a Llama/Qwen checkpoint is this: asyncrl's names are HF's)
    PermuteRoPE     GGUF q/k rows: llama.cpp reorders each head's rows for its RoPE (see the class)
    StackExperts    HF's one module per expert <-> asyncrl's stacked [num_experts, out, in] tensor, row j
    FuseGateUp      transformers 5's fused [E, 2·I, H] gate_up_proj <-> asyncrl's gate_proj, up_proj [E, I, H]
    Ignore          a tensor that carries nothing asyncrl keeps (tied lm_head copies, RoPE caches)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from model.config import ModelConfig

Get = Callable[[str], torch.Tensor]
Rows = Callable[[str], "range | None"]
"""asyncrl parameter name -> the dim-0 rows a sharded rank keeps (None: the whole parameter)."""
ReadRows = Callable[["range | None"], torch.Tensor]
"""Rows of one source tensor (None: all of them) -> those rows, read from the file."""


@dataclass(frozen=True)
class Piece:
    """Part of an asyncrl parameter: `param[index] = tensor` (index () = the whole parameter)."""

    name: str
    index: tuple
    tensor: torch.Tensor


@dataclass(frozen=True)
class Step:
    source: str
    """Source name template; {i} = layer, {j} = expert."""
    ours: str
    """asyncrl name template (the same fields)."""
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        pattern = re.escape(self.source).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)")
        object.__setattr__(self, "regex", re.compile(pattern))

    def match(self, name: str) -> dict[str, int] | None:
        m = self.regex.fullmatch(name)
        return None if m is None else {k: int(v) for k, v in m.groupdict().items()}

    def instances(self, cfg: ModelConfig) -> Iterator[dict[str, int]]:
        """Every field assignment the architecture has: layers {i}, experts {j}."""
        layers = range(cfg.num_layers) if "{i}" in self.source else [None]
        experts = range(cfg.ffn.num_experts) if "{j}" in self.source else [None]
        for i in layers:
            for j in experts:
                yield {k: v for k, v in (("i", i), ("j", j)) if v is not None}

    def to_ours(self, f: dict[str, int], t: torch.Tensor) -> list[Piece]:
        raise NotImplementedError

    def from_ours(self, f: dict[str, int], get: Get) -> torch.Tensor:
        raise NotImplementedError

    def to_ours_rows(self, f: dict[str, int], read: ReadRows, rows: Rows) -> list[Piece]:
        """The pieces of the rows a rank holds: `rows(param)` is the dim-0 range of asyncrl parameter `param`
        kept (None: all of it), `read(r)` reads rows `r` of the source tensor (None: all). A piece's index
        and tensor are relative to the kept rows. Default: read everything, convert, cut."""
        return [c for p in self.to_ours(f, read(None)) if (c := _cut(p, rows(p.name))) is not None]


def _cut(p: Piece, keep: range | None) -> Piece | None:
    """Piece `p` of a whole parameter restricted to the parameter's rows `keep` (None: unchanged)."""
    if keep is None:
        return p
    if not p.index:
        return Piece(p.name, (), p.tensor[keep.start : keep.stop])
    j = p.index[0]
    return Piece(p.name, (j - keep.start, *p.index[1:]), p.tensor) if j in keep else None


class Rename(Step):
    def to_ours(self, f, t):
        return [Piece(self.ours.format(**f), (), t)]

    def from_ours(self, f, get):
        return get(self.ours.format(**f))

    def to_ours_rows(self, f, read, rows):  # the parameter's rows are the source's
        return [Piece(self.ours.format(**f), (), read(rows(self.ours.format(**f))))]


@dataclass(frozen=True)
class PermuteRoPE(Step):
    """llama.cpp's q/k row order. HF Llama rotates pairs (x_r, x_{r+D/2}) of each head ("rotate half");
    llama.cpp's plain RoPE rotates adjacent pairs (x_{2r}, x_{2r+1}). convert_hf_to_gguf.py therefore
    reorders the rows of q_proj / k_proj (and their biases) within every head so that HF row r lands at
    GGUF row 2r and HF row r + D/2 at GGUF row 2r + 1:

        gguf = hf.reshape(heads, 2, D/2, ...).swapaxes(1, 2).reshape(hf.shape)       (from_ours)
        hf   = gguf.reshape(heads, D/2, 2, ...).swapaxes(1, 2).reshape(gguf.shape)   (to_ours, the inverse)

    with heads = num_heads for q and num_kv_heads for k. Qwen2/Qwen3 GGUFs use llama.cpp's NEOX RoPE
    (rotate half, as HF) and are not permuted."""

    heads: int = 0

    def _perm(self, t: torch.Tensor, inverse: bool) -> torch.Tensor:
        half = t.shape[0] // self.heads // 2
        split = (self.heads, half, 2) if inverse else (self.heads, 2, half)
        return t.reshape(*split, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def to_ours(self, f, t):
        return [Piece(self.ours.format(**f), (), self._perm(t, inverse=True))]

    def from_ours(self, f, get):
        return self._perm(get(self.ours.format(**f)), inverse=False)


class StackExperts(Step):
    """Source: one tensor per expert {j}; ours: row j of the stacked [num_experts, ...] parameter."""

    def to_ours(self, f, t):
        return [Piece(self.ours.format(**f), (f["j"],), t)]

    def to_ours_rows(self, f, read, rows):  # expert j's file tensor is read only by the rank that holds row j
        keep = rows(self.ours.format(**f))
        if keep is not None and f["j"] not in keep:
            return []
        return super().to_ours_rows(f, read, rows)

    def from_ours(self, f, get):
        return get(self.ours.format(**f))[f["j"]]


@dataclass(frozen=True)
class FuseGateUp(Step):
    """Source [E, 2·I, H] = cat(gate [E, I, H], up [E, I, H], dim=1) (transformers 5's Qwen3MoeExperts
    `gate_up_proj`: gate rows first); ours: `ours` is the gate template, `up` the up template."""

    up: str = ""

    def to_ours(self, f, t):
        inter = t.shape[1] // 2
        return [Piece(self.ours.format(**f), (), t[:, :inter]), Piece(self.up.format(**f), (), t[:, inter:])]

    def to_ours_rows(self, f, read, rows):  # dim 0 is the expert for the source and both parameters
        return self.to_ours(f, read(rows(self.ours.format(**f))))

    def from_ours(self, f, get):
        return torch.cat([get(self.ours.format(**f)), get(self.up.format(**f))], dim=1)


class Ignore(Step):
    """A source tensor with nothing to load (never exported)."""

    def instances(self, cfg):
        return iter(())

    def to_ours(self, f, t):
        return []

    def to_ours_rows(self, f, read, rows):
        return []


class UnknownTensor(ValueError):
    pass


@dataclass(frozen=True)
class Conversion:
    steps: tuple[Step, ...]
    cfg: ModelConfig

    def step_for(self, name: str) -> tuple[Step, dict[str, int]] | None:
        for step in self.steps:
            f = step.match(name)
            if f is not None:
                return step, f
        return None

    def to_ours(self, name: str, t: torch.Tensor) -> list[Piece]:
        found = self.step_for(name)
        if found is None:
            raise UnknownTensor(name)
        return found[0].to_ours(found[1], t)

    def to_ours_rows(self, name: str, read: ReadRows, rows: Rows) -> list[Piece]:
        """`to_ours` for the rows a sharded rank holds (Step.to_ours_rows)."""
        found = self.step_for(name)
        if found is None:
            raise UnknownTensor(name)
        return found[0].to_ours_rows(found[1], read, rows)

    def source_names(self) -> Iterator[tuple[str, Step, dict[str, int]]]:
        """Every source tensor of the architecture (in a stable order), with its step."""
        for step in self.steps:
            for f in step.instances(self.cfg):
                yield step.source.format(**f), step, f

    def export(self, get: Get) -> Iterator[tuple[str, torch.Tensor]]:
        """(source name, tensor) for every source tensor, rebuilt from asyncrl's parameters."""
        for name, step, f in self.source_names():
            yield name, step.from_ours(f, get)


# -- the declared conversions -------------------------------------------------------------------------------
L = "model.layers.{i}."


def hf_conversion(cfg: ModelConfig, expert_layout: str = "per_expert") -> Conversion:
    """Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE names. asyncrl's names are HF's except the routed
    experts: `per_expert` (what save_pretrained writes: mlp.experts.{j}.gate_proj.weight, ...) or `fused`
    (transformers 5's in-memory layout: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I])."""
    def same(name: str) -> Step:
        return Rename(name, name)

    steps: list[Step] = [same("model.embed_tokens.weight"), same("model.norm.weight")]
    steps.append(Ignore("lm_head.weight", "") if cfg.tie_word_embeddings else same("lm_head.weight"))
    for n in ("input_layernorm", "post_attention_layernorm"):
        steps.append(same(L + n + ".weight"))
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        steps.append(same(L + f"self_attn.{n}.weight"))
    if cfg.attention_bias:
        steps += [same(L + f"self_attn.{n}.bias") for n in ("q_proj", "k_proj", "v_proj")]
    if cfg.qk_norm:
        steps += [same(L + "self_attn.q_norm.weight"), same(L + "self_attn.k_norm.weight")]
    if not cfg.is_moe:
        steps += [same(L + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")]
    else:
        steps.append(same(L + "mlp.gate.weight"))
        E = L + "mlp.experts."
        if expert_layout == "per_expert":
            steps += [StackExperts(E + "{j}." + n + ".weight", E + n) for n in ("gate_proj", "up_proj", "down_proj")]
        elif expert_layout == "fused":
            steps += [FuseGateUp(E + "gate_up_proj", E + "gate_proj", up=E + "up_proj"), same(E + "down_proj")]
        else:
            raise ValueError(f"expert_layout must be per_expert or fused, got {expert_layout!r}")
    steps.append(Ignore(L + "self_attn.rotary_emb.inv_freq", ""))  # a RoPE cache some old checkpoints saved
    return Conversion(tuple(steps), cfg)


def identity_conversion(cfg: ModelConfig, names: list[str]) -> Conversion:
    """asyncrl's own checkpoints: every tensor under its own name (the tied lm_head is not stored)."""
    return Conversion(tuple(Rename(n, n) for n in names), cfg)


def hf_expert_layout(names: list[str]) -> str:
    """Which expert layout a checkpoint's tensor names use."""
    return "fused" if any(n.endswith(".mlp.experts.gate_up_proj") for n in names) else "per_expert"


def gguf_conversion(cfg: ModelConfig, arch: str) -> Conversion:
    """llama.cpp's GGUF names (gguf-py `tensor_mapping.py`) for arch llama | qwen2 | qwen3 | qwen3moe.
    GGUF dims are stored fastest-first; `GGUFFile.dequantized` returns them in row-major order, so a
    [out, in] weight and a stacked [E, out, in] expert tensor arrive in asyncrl's orientation."""
    B = "blk.{i}."
    steps: list[Step] = [Rename("token_embd.weight", "model.embed_tokens.weight"), Rename("output_norm.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        steps.append(Rename("output.weight", "lm_head.weight"))
    steps += [Rename(B + "attn_norm.weight", L + "input_layernorm.weight"),
              Rename(B + "ffn_norm.weight", L + "post_attention_layernorm.weight")]
    for g, ours, heads in (("attn_q", "q_proj", cfg.num_heads), ("attn_k", "k_proj", cfg.num_kv_heads)):
        for kind in ("weight",) + (("bias",) if cfg.attention_bias else ()):
            src, dst = B + f"{g}.{kind}", L + f"self_attn.{ours}.{kind}"
            steps.append(PermuteRoPE(src, dst, heads=heads) if arch == "llama" else Rename(src, dst))
    steps.append(Rename(B + "attn_v.weight", L + "self_attn.v_proj.weight"))
    if cfg.attention_bias:
        steps.append(Rename(B + "attn_v.bias", L + "self_attn.v_proj.bias"))
    steps.append(Rename(B + "attn_output.weight", L + "self_attn.o_proj.weight"))
    if cfg.qk_norm:
        steps += [Rename(B + "attn_q_norm.weight", L + "self_attn.q_norm.weight"),
                  Rename(B + "attn_k_norm.weight", L + "self_attn.k_norm.weight")]
    if not cfg.is_moe:
        steps += [Rename(B + f"ffn_{n}.weight", L + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down")]
    else:
        steps.append(Rename(B + "ffn_gate_inp.weight", L + "mlp.gate.weight"))
        steps += [Rename(B + f"ffn_{n}_exps.weight", L + f"mlp.experts.{n}_proj") for n in ("gate", "up", "down")]
    return Conversion(tuple(steps), cfg)
