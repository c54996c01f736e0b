"""transformers 5's fused expert layout (model/conversion.py `FuseGateUp`): Qwen3MoeExperts.gate_up_proj
[E, 2I, H] = cat(gate, up, dim=1), gate rows first, loads into asyncrl's gate_proj and up_proj and exports back to
the same tensor. A swapped split loads without an error and computes another model; this checks it without
transformers (tests/unit/test_pretrained.py compares whole models with it)."""

import torch

from model.conversion import hf_conversion
from tests.conftest import debug_config

NAME = "model.layers.0.mlp.experts."


def test_a_fused_gate_up_projection_is_split_gate_rows_first_and_rebuilt():
    conversion = hf_conversion(debug_config(moe=True), "fused")
    gate, up = torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    fused = torch.cat([gate, up], 1)
    got = {p.name: p.tensor for p in conversion.to_ours(NAME + "gate_up_proj", fused)}
    assert torch.equal(got[NAME + "gate_proj"], gate) and torch.equal(got[NAME + "up_proj"], up)
    step, fields = conversion.step_for(NAME + "gate_up_proj")
    assert torch.equal(step.from_ours(fields, got.__getitem__), fused)
