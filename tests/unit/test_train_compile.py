"""torch.compile for the training forward (model/compile.py, issue #41): the compiled step is the eager step, the
state dict and the rollout copy do not see it, and the recipe's `run.compile` resolves as documented.

The CPU runs torch.compile's "aot_eager" backend: dynamo traces the layer, AOTAutograd builds its forward and backward
graphs and they run op by op, so the arithmetic is checked without inductor's C++ build; inductor's Triton kernels run
on the GPU (bench/train_step.py's `+compile` arms compare them against eager there)."""

from __future__ import annotations

import copy

import pytest
import torch

from model.decoder import Decoder
from rl.config import GRPOStage, OptimConfig
from rl.recipe_io import RecipeError, load_recipe
from rl.train.objectives import GRPOObjective
from rl.train.trainer import Trainer
from tests.conftest import debug_config
from tests.unit.test_packed_training import _with_routing
from tests.unit.test_trainer import _rows


def _grads(model: Decoder, rows, packing: str) -> tuple[torch.Tensor, float]:
    trainer = Trainer(model, OptimConfig())
    objective = GRPOObjective(GRPOStage(group_size=4, micro_batch_size=6, packing=packing), model=model,
                              temperature=0.9, current_version=0)
    metrics = trainer.accumulate(rows, objective)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), metrics.sums["rl/loss"]


@pytest.mark.parametrize(("moe", "mode", "packing"), [(False, "layers", "padded"), (False, "layers", "packed"),
                                                      (False, "ops", "packed"), (True, "layers", "padded")])
def test_a_compiled_step_is_the_eager_step(moe, mode, packing):
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=moe)).float()
    rows = _rows(12, seed=2)
    if moe:
        rows = _with_routing(model, rows)
    eager, eager_loss = _grads(copy.deepcopy(model), rows, packing)
    compiled_model = copy.deepcopy(model)
    compiled_model.compile_for_training(mode, backend="aot_eager")
    # MoE layers are never compiled whole (data-dependent dispatch): they take the elementwise functions instead
    assert (compiled_model._compiled_layers is not None) == (mode == "layers" and not moe)
    compiled, compiled_loss = _grads(compiled_model, rows, packing)
    rel = float((compiled - eager).norm() / eager.norm())
    assert rel < 1e-5, rel  # float32: the same operations, decomposed (rounding of the order of 1e-7 here)
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    # the state dict, a no-grad forward and the rollout copy do not see the compilation
    assert list(compiled_model.state_dict()) == list(model.state_dict())
    ids = torch.tensor([rows.prompts_B[0]])
    with torch.no_grad():
        assert torch.equal(compiled_model.forward_hidden(ids).hidden, copy.deepcopy(compiled_model).forward_hidden(ids).hidden)
    compiled_model.compile_for_training(None)
    assert compiled_model._compiled_layers is None
    assert all(getattr(m, "compile_backend", None) is None for m in compiled_model.modules())
    with pytest.raises(ValueError, match="compile mode 'all'"):
        compiled_model.compile_for_training("all")


def test_a_lora_models_layers_share_one_compiled_graph():
    """LoRA freezes the embedding, so layer 0's input has no gradient while every later layer's has: torch.compile's
    guards then make layer 0 a second graph, compiled twice over, forward and backward (on the H200 LoRA's first step
    took 77 s against full fine-tuning's 15 s). The training forward asks for the input's gradient, so every layer
    takes one graph; the adapters' gradients are eager's."""
    from torch._dynamo.utils import counters

    from model.lora import apply_lora

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False, num_layers=3, lora={"rank": 4, "alpha": 8})).float()
    apply_lora(model, model.config.lora)
    for layer in model.model.layers:  # B = 0 would leave A without a gradient
        for m in layer.modules():
            if hasattr(m, "lora_B"):
                torch.nn.init.normal_(m.lora_B, std=0.1)
    rows = _rows(12, seed=2)
    eager, _ = _grads(copy.deepcopy(model), rows, "padded")
    compiled_model = copy.deepcopy(model)
    compiled_model.compile_for_training("layers", backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = _grads(compiled_model, rows, "padded")
    layer_graphs = counters["stats"]["unique_graphs"] - 1  # the final norm's
    assert layer_graphs == 1, dict(counters["stats"])
    assert float((compiled - eager).norm() / eager.norm()) < 1e-5


def test_run_compile_resolves_per_device_precision_and_parallelism():
    def mode(**run):
        runtime = run.pop("runtime", {})
        overrides = [f"run.{k}={v}" for k, v in run.items()] + [f"runtime.{k}={v}" for k, v in runtime.items()]
        return load_recipe("configs/quickstart.yaml", overrides).compile_mode()

    assert mode(device="cuda", dtype="bfloat16") == "layers"
    assert mode(device="cuda", dtype="float32") is None  # FlashAttention's varlen kernel takes half precision only
    assert mode(device="cpu", dtype="bfloat16") is None
    assert mode(device="cpu", compile="ops") == "ops"
    assert mode(device="cuda", dtype="bfloat16", compile="off") is None  # YAML reads off as false
    assert mode(device="cpu", compile="true") == "layers"
    assert mode(device="cuda", dtype="bfloat16", runtime={"num_workers": 2, "parallel": "fsdp2"}) is None
    assert mode(device="cuda", dtype="bfloat16", runtime={"num_workers": 2}) == "layers"
    with pytest.raises(RecipeError, match="run.compile layers with runtime.parallel fsdp2 is not supported"):
        mode(device="cuda", compile="layers", runtime={"num_workers": 2, "parallel": "fsdp2"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's Triton kernels need a GPU")
def test_on_cuda_inductors_compiled_layers_give_the_eager_steps_gradients():
    """bf16 autocast, packed rows (FlashAttention varlen inside the compiled graph): the same gradient as eager within
    bf16 rounding (inductor fuses the float32 norms and casts differently; 2% of the gradient's norm)."""
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False, max_position_embeddings=512)).float().cuda()
    rows = _rows(16, seed=4)
    grads = []
    for mode in (None, "layers"):
        m = copy.deepcopy(model)
        m.compile_for_training(mode)
        trainer = Trainer(m, OptimConfig(), device="cuda", autocast=torch.bfloat16)
        objective = GRPOObjective(GRPOStage(group_size=4, micro_batch_size=6, packing="packed"), model=m,
                                  temperature=0.9, current_version=0)
        trainer.accumulate(rows, objective)
        grads.append(torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]))
    rel = float((grads[1] - grads[0]).norm() / grads[0].norm())
    assert rel < 2e-2, rel
