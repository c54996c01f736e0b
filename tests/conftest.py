import os

import pytest
import torch

# Triton kernels run in interpreter mode where there is no GPU (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model.config import DenseFFNConfig, ModelConfig, MoEFFNConfig
from rewards.task import Trajectory, VerifyContext


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def debug_config(moe: bool = True, **kw) -> ModelConfig:
    """The tiny 'debug' model flavour: 2 layers, width 64. init_std is large so logits are peaked
    enough for sampling to differ between prompts and to stop on EOS sometimes."""
    ffn = MoEFFNConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else DenseFFNConfig(intermediate_size=128)
    base = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, init_std=0.15, ffn=ffn)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture
def moe_model():
    from model.decoder import Decoder

    torch.manual_seed(0)
    return Decoder(debug_config(moe=True)).eval()


@pytest.fixture
def dense_model():
    from model.decoder import Decoder

    torch.manual_seed(0)
    return Decoder(debug_config(moe=False)).eval()


def verify_text(task, problem, response):
    """A task's verdict on a one-turn response."""
    return task.verify(Trajectory.single(problem, response), VerifyContext())


def parsed(verdict) -> str | None:
    """The answer a procedural verdict read, from its reason ("answer 92, expected 961" -> "92"); None when none."""
    return verdict.reason.removeprefix("answer ").split(",")[0] if verdict.reason.startswith("answer ") else None


def len_reasoning(task, response: str) -> int:
    """ℓ of the length penalty under the char tokenizer (one token per character)."""
    return len(task.reasoning(response))


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server for the session (tests/postgres.py). Missing PostgreSQL skips locally and
    fails under CI=true (.ci/run installs it), so CI never passes without running these tests."""
    from tests.postgres import PostgresServer, unavailable

    why = unavailable()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the PostgreSQL tests cannot run: {why}")
        pytest.skip(why)
    server = PostgresServer()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server):
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return postgres_server.create_database()
