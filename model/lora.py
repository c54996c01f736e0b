"""Low-rank adapters (LoRA; `model.lora`, model/config.py `LoraConfig`), in PEFT's layout.

A targeted `nn.Linear` becomes a `LoraLinear` in place (same module, same `weight` and `bias` names, so base
checkpoints load as they are) with two more parameters, `lora_A` [r, in] and `lora_B` [out, r], float32:

    y = W x + b + s · B A dropout(x),        s = alpha / r

Only the adapters train (`apply_lora` freezes every other parameter: no gradient, no optimizer state). The rollout
engine reads weights directly, never a layer's forward, so it decodes a plain copy whose targeted weights are the
merged W + s · B A (`merged_weight`), recomputed from the untouched base after every optimizer step
(rl/runtime/worker.py `refresh_rollout_copy`): no drift, however many updates. A LoRA checkpoint read as a plain
model (`rl eval --checkpoint`, `rl export`, `rl merge`, an OPD teacher) is merged the same way (`merge_lora_state`).
MoE routed experts are stacked tensors, not linear layers: they stay frozen.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from model.config import LoraConfig, ModelConfig

ADAPTERS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """A state-dict or parameter name of an adapter (`<layer>.lora_A`, `<layer>.lora_B`)."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


class LoraLinear(nn.Linear):
    """An `nn.Linear` with adapters (made by `apply_lora` from an existing layer, never constructed)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float
    lora_dropout: nn.Module
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return y
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)  # float32 adapters beside a base of another dtype
        return y + F.linear(F.linear(self.lora_dropout(x), a), b) * self.lora_scaling


def _adapt(layer: nn.Linear, cfg: LoraConfig) -> LoraLinear:
    out_f, in_f = layer.weight.shape
    device = layer.weight.device
    a = torch.empty(cfg.rank, in_f, device=device, dtype=torch.float32)
    if cfg.init == "kaiming":  # nn.Linear's (and PEFT's) default for A
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    else:
        nn.init.normal_(a, std=1 / cfg.rank)
    layer.__class__ = LoraLinear
    layer.lora_A = nn.Parameter(a)
    layer.lora_B = nn.Parameter(torch.zeros(out_f, cfg.rank, device=device, dtype=torch.float32))
    layer.lora_scaling = cfg.scaling
    layer.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    layer.lora_enabled = True
    return layer


def apply_lora(model: nn.Module, cfg: LoraConfig) -> int:
    """Adapt every linear layer whose name is in `cfg.targets` (its last component: `...self_attn.q_proj`) and freeze
    every other parameter; returns how many were adapted (ValueError when none is: the targets name no layer here).
    Idempotent on an adapted model."""
    targets, n = set(cfg.targets), 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            if not isinstance(module, LoraLinear):
                _adapt(module, cfg)
            n += 1
    if n == 0:
        raise ValueError(f"model.lora.targets {cfg.targets} name no linear layer of this model")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return n


def base_to(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the adapted layers' frozen weights in `dtype` (bf16 under mixed precision: autocast casts them to it at
    every forward anyway, so the forward is unchanged and no float32 master copy is kept); returns the bytes saved.
    Biases, norms, embeddings and the adapters keep theirs."""
    saved = 0
    for layer in lora_layers(model).values():
        w = layer.weight
        saved += w.numel() * (w.element_size() - torch.empty((), dtype=dtype).element_size())
        w.data = w.data.to(dtype)
    return saved


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """The adapted layers by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


def _wide(w: torch.Tensor) -> torch.dtype:
    """The merge's arithmetic: float32, or the weight's own when wider (a float64 reference)."""
    return torch.promote_types(w.dtype, torch.float32)


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s · B A in float32 (float64 for a float64 base), one fused addmm: the engine's weight update
    (`merged_weight`, every adapted layer after every optimizer step) and the checkpoint readers (`merge_lora_state`)
    round alike, so the weights that `rl eval` reads are those the engine decoded."""
    dt = _wide(w)
    return torch.addmm(w.to(dt), b.to(dt), a.to(dt), alpha=scaling)


def merged_weight(layer: LoraLinear) -> torch.Tensor:
    """W + s · B A of an adapted layer (`merge`; the caller casts into its copy)."""
    return merge(layer.weight, layer.lora_A, layer.lora_B, layer.lora_scaling)


@torch.no_grad()
def merged_copy(model: nn.Module) -> nn.Module:
    """A deep copy with every `LoraLinear` turned back into a plain `nn.Linear` holding the merged weight: the
    parameter names of a model without adapters (what the engine and the exporters read)."""
    twin = copy.deepcopy(model)
    for layer in lora_layers(twin).values():
        layer.weight.copy_(merged_weight(layer).to(layer.weight.dtype))
        for attr in (*ADAPTERS, "lora_dropout"):
            delattr(layer, attr)
        for attr in ("lora_scaling", "lora_enabled"):
            del layer.__dict__[attr]
        layer.__class__ = nn.Linear
    return twin


class adapters_off:
    """`with adapters_off(model):` the base's forward (the KL reference of a LoRA run, with no second copy)."""

    def __init__(self, model: nn.Module):
        self.layers = list(lora_layers(model).values())

    def __enter__(self):
        for layer in self.layers:
            layer.lora_enabled = False

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.lora_enabled = True


def merge_lora_state(state: Mapping[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """A LoRA state dict as the plain model's: each adapted `<layer>.weight` merged with its `<layer>.lora_A` and
    `<layer>.lora_B` (float32 arithmetic or wider, cast back to the weight's dtype), the adapters dropped."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_A"):
            layer = key.removesuffix(".lora_A")
            w = state[f"{layer}.weight"]
            out[f"{layer}.weight"] = merge(w, state[key], state[f"{layer}.lora_B"], cfg.scaling).to(w.dtype)
    return out


def as_plain(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """A checkpoint's (config, state) as a model without adapters: a LoRA run's merged (`merge_lora_state`), any
    other's as it is (what `rl merge`, `rl export` and an OPD teacher read)."""
    if cfg.lora is None:
        return cfg, state
    return cfg.model_copy(update={"lora": None}), merge_lora_state(state, cfg.lora)
