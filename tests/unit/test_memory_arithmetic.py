"""`rl validate` never builds the model (issue 40, class 7): the memory estimate counts parameters from one period of
layers on the meta device and arithmetic, so that a 20,000-layer recipe is as quick to validate as a 4-layer one,
and the count is exactly what the built Decoder holds."""

import pytest
import torch

from model import decoder
from model.config import ModelConfig
from rl.recipe_io import load_recipe
from rl.runtime.memory import estimate, parameter_count

SPARSE = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
          "sparse_attention": {"topk": 8, "window": 8, "index_dim": 8, "layer_modes": ["full", "reindex", "reuse", "reuse"]}}


@pytest.mark.parametrize("fields", [
    {},
    {"num_layers": 3, "tie_word_embeddings": True, "qk_norm": True, "attention_bias": True},
    {"num_layers": 5, "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "num_shared_experts": 1}},
    {**SPARSE, "num_layers": 7},
    {**SPARSE, "num_layers": 2},
    {**SPARSE, "num_layers": 8},
], ids=["dense", "tied-qknorm-bias", "moe-shared", "csa2-7", "csa2-2", "csa2-8"])
def test_the_count_is_what_the_built_decoder_holds(fields):
    cfg = ModelConfig.model_validate(fields)
    with torch.device("meta"):
        built = decoder.Decoder(cfg).num_parameters()
    assert parameter_count(cfg) == built


def test_a_huge_recipe_is_estimated_without_building_its_model(monkeypatch):
    """Building the decoder at all is a bug here: 20,000 layers took 20 s; the count builds at most one period of
    layers, whatever num_layers is."""
    built = []
    real = decoder.DecoderLayer.__init__

    def counting(self, cfg, layer_idx):
        built.append(layer_idx)
        real(self, cfg, layer_idx)

    monkeypatch.setattr(decoder.DecoderLayer, "__init__", counting)
    recipe = load_recipe("configs/quickstart.yaml", ["model.num_layers=20000"])
    parts = estimate(recipe)
    assert len(built) <= 1
    small = estimate(load_recipe("configs/quickstart.yaml", ["model.num_layers=2"]))
    one_layer = (small["parameters"] - estimate(load_recipe("configs/quickstart.yaml", ["model.num_layers=1"]))["parameters"])
    assert parts["parameters"] == small["parameters"] + 19998 * one_layer
