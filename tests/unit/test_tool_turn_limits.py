"""Which limit ends a tool call (rl/runtime/tool_turns.py): of the recipe's `tools.timeout_s` and the sandbox's own
`timeout_s` the smaller wins, whichever it is; a call the sandbox kills fails its sample (repercussion) instead
of being appended as output; a sample that already made `max_turns` calls is finished without another. The real
engine (tiny model, char tokenizer) and a real sandbox server (bubblewrap); each sample starts paused at its call,
as in tests/integration/test_tool_turns.py."""

import time

import pytest
import torch

from model.decoder import Decoder
from model.tokenizer import CharTokenizer
from rl.runtime.tool_turns import ToolTurns, run_to_completion
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.tool_calls import PYTHON_TOOL
from rollout.types import GenerationRequest, RolloutState
from tests.sandbox_server import bwrap_server
from sandbox_client import Limits
from tests.conftest import debug_config

SLEEP = "```python\nimport time; time.sleep(60); print('late')\n```"
PRINT = "```python\nprint(6*7)\n```"


@pytest.fixture(scope="module")
def socket_path():
    with bwrap_server("asyncrl-tool-limits-") as (_, path):
        yield path


def _run(socket_path, turn: str, *, tools_timeout: float, sandbox_timeout: float, max_turns: int = 2,
         turns_made: int = 0):
    """One sample paused at `turn` (after `turns_made` earlier tool turns) driven to the end -> (generation, seconds,
    tool stats)."""
    torch.manual_seed(0)
    tok = CharTokenizer()
    engine = Engine(Decoder(debug_config(moe=False)).eval(), EngineConfig(max_batch_size=2, block_size=4, max_seq_len=200),
                    eos_id=tok.eos_id)
    tools = ToolTurns(tok, fmt="code", specs=[PYTHON_TOOL], max_turns=max_turns, max_output_tokens=20,
                      timeout_s=tools_timeout, socket_path=socket_path, limits=Limits(timeout_s=sandbox_timeout))
    tools.attach(engine)
    prompt = tuple(tok.encode("Q: 6*7?\nA: ", bos=True))
    engine.add([GenerationRequest("s", prompt, 80, seed=3, tool_calls=True)])
    engine.step()
    (st,) = engine.interrupt()
    call = tok.encode(turn)
    st.tokens = list(prompt) + call
    st.logprobs, st.policy_versions = [0.0] * len(call), [0] * len(call)
    st.num_cached, st.paused = len(prompt), True
    st.tool_turns = [{"status": "ok", "start": 0, "end": 0}] * turns_made
    engine.resume([RolloutState.from_bytes(st.to_bytes())])
    t0 = time.monotonic()
    try:
        (g,) = run_to_completion(engine, tools)
        return g, time.monotonic() - t0, dict(tools.stats)
    finally:
        tools.shutdown()


@pytest.mark.parametrize("tools_timeout, sandbox_timeout", [(0.5, 30.0), (30.0, 0.5)])
def test_the_smaller_of_the_two_timeouts_ends_the_call_and_fails_its_sample(socket_path, tools_timeout, sandbox_timeout):
    g, seconds, stats = _run(socket_path, SLEEP, tools_timeout=tools_timeout, sandbox_timeout=sandbox_timeout)
    assert seconds < 20  # the 60 s call was cut at 0.5 s (plus the sandbox's start, slow on a busy machine), not at 30 s
    assert g.finish_reason == "tool_failure" and stats["tool_failures"] == 1
    (turn,) = g.tool_turns[-1:]
    assert turn["failure"] == "timeout" and "late" not in turn["output"]


def test_a_sample_at_max_turns_is_finished_without_another_call(socket_path):
    g, _, stats = _run(socket_path, PRINT, tools_timeout=5.0, sandbox_timeout=5.0, max_turns=1, turns_made=1)
    assert g.finish_reason == "max_turns" and stats["calls"] == 0 and stats["max_turns"] == 1
    g, _, stats = _run(socket_path, PRINT, tools_timeout=5.0, sandbox_timeout=5.0, max_turns=2, turns_made=1)
    assert stats["calls"] == 1 and g.tool_turns[-1]["output"] == "42" and g.tool_turns[-1]["failure"] is None
