"""Multi-turn tool calls end to end in one process (issue #16, part 2): the real engine (tiny model, char tokenizer),
the real stop matcher and parser, a real sandbox server (bubblewrap). The tiny random model does not write calls
by itself, so each sample's first turn is put in its RolloutState as if the model had written it (its KV not yet
cached), and the sample resumes paused at that call: from there every step is the production path. The call runs
in the sample's sandbox while other samples decode, its output is appended as its own tokens and prefilled over
the cached context, an interrupt while a call runs loses nothing, the turn limit ends a sample, and a call the
sandbox kills (CPU time, memory) ends its sample with the reason (repercussion)."""

import io
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model.decoder import Decoder
from model.tokenizer import CharTokenizer
from rl.runtime.tool_turns import ToolTurns, run_to_completion
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.tool_calls import PYTHON_TOOL, tool_result_tokens
from rollout.types import GenerationRequest, RolloutState
from sandbox_client import Limits, LocalServer
from tests.conftest import debug_config

pytestmark = pytest.mark.integration


@pytest.fixture
def server():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-tool-turns-"))
    scratch.chmod(0o711)
    srv = LocalServer(scratch / "s.sock", scratch / "state", max_sandboxes=4)
    yield srv, scratch / "s.sock"
    srv.stop()
    shutil.rmtree(scratch, ignore_errors=True)


def _paused_at(engine: Engine, tok: CharTokenizer, sample_id: str, turn: str, tool_turns: list | None = None) -> RolloutState:
    """A state paused at `turn` (the model's first turn, ending in a call), its prompt's KV cached."""
    prompt = tuple(tok.encode("Q: what is 6*7?\nA: ", bos=True))
    engine.add([GenerationRequest(sample_id, prompt, 300, seed=3, tool_calls=True)])
    engine.step()  # prefill: the prompt's KV, one sampled token (replaced below)
    (st,) = engine.interrupt()
    call = tok.encode(turn)
    st.tokens = list(prompt) + call
    st.logprobs, st.policy_versions = [0.0] * len(call), [0] * len(call)
    st.num_cached, st.paused, st.tool_turns = len(prompt), True, list(tool_turns or [])
    return RolloutState.from_bytes(st.to_bytes())


def _drive(engine: Engine, tools: ToolTurns):
    return {g.sample_id: g for g in run_to_completion(engine, tools)}


def test_tool_calls_run_in_the_sandbox_and_their_output_is_appended(server):
    _, sock = server
    torch.manual_seed(0)
    tok = CharTokenizer()
    engine = Engine(Decoder(debug_config(moe=False)).eval(), EngineConfig(max_batch_size=8, block_size=4, max_seq_len=400),
                    eos_id=tok.eos_id)
    tools = ToolTurns(tok, fmt="code", specs=[PYTHON_TOOL], max_turns=1, max_output_tokens=40, timeout_s=5,
                      socket_path=sock, limits=Limits(timeout_s=5, cpu_s=1))
    tools.attach(engine)
    turns = {"ok": "```python\nimport time; time.sleep(0.3); print(6*7)\n```", "bad": "```python\nprint(6*\n```",
             "spin": "```python\nwhile True: pass\n```", "hog": "```python\nx = b'x' * (400 << 20)\n```"}
    states = [_paused_at(engine, tok, sid, t) for sid, t in turns.items()]
    states.append(_paused_at(engine, tok, "limit", turns["ok"], tool_turns=[{"status": "ok", "start": 0, "end": 0}]))
    engine.resume(states)
    engine.step()  # admits them paused: nothing to feed until their tools answer
    assert engine.num_paused == 5 and not engine.runnable()
    tools.service(engine)
    # an interrupt while the calls run (a weight update): the calls go on, their outputs land after the resume
    held = [RolloutState.from_bytes(s.to_bytes()) for s in engine.interrupt()]
    assert {s.request.sample_id for s in held if s.paused} == {"ok", "bad", "spin", "hog"}  # "limit" was finished
    engine.resume(held)
    gens = _drive(engine, tools)
    assert set(gens) == {"ok", "bad", "spin", "hog"}
    # repercussion: a call the server killed (CPU time, memory) ends its sample there, nothing appended, the reason kept
    for sid, failure, status in (("spin", "cpu", "timeout"), ("hog", "memory", "error")):
        g = gens.pop(sid)
        (turn,) = g.tool_turns
        n = len(tok.encode(turns[sid]))
        assert g.finish_reason == "tool_failure" and len(g.response_tokens) == n and not g.appended_spans
        assert (turn["failure"], turn["status"], turn["start"], turn["end"]) == (failure, status, n, n), turn
    assert tools.stats["tool_failures"] == 2
    for sid, g in gens.items():
        (turn,) = g.tool_turns
        s, e = g.appended_spans[0]
        assert (turn["start"], turn["end"]) == (s, e) and s == len(tok.encode(turns[sid]))
        want = tool_result_tokens(tok, turn["output"], max_tokens=40).tokens
        assert g.response_tokens[s:e] == tuple(want)[: e - s]  # token in, token out: exactly the tool's own tokens
        assert all(g.logprobs[t] == 0.0 for t in range(s, e)) and e < len(g.response_tokens)  # the model went on
    assert gens["ok"].tool_turns[0]["status"] == "ok" and gens["ok"].tool_turns[0]["output"] == "42"
    assert gens["ok"].tool_turns[0]["tool"] == "python" and gens["ok"].tool_turns[0]["wall_s"] >= 0.3
    bad = gens["bad"].tool_turns[0]  # a traceback longer than 40 tokens: cut, and the cut marked and recorded
    assert bad["status"] == "error" and bad["output"].startswith('  File "<string>"') and bad["truncated"]
    assert bad["output"].endswith("[tool output truncated to 40 tokens]") and not gens["ok"].tool_turns[0]["truncated"]
    assert gens["ok"].tool_turns[0]["failure"] is None and gens["bad"].tool_turns[0]["failure"] is None
    assert tools.stats["max_turns"] == 1 and tools.stats["calls"] == 4
    tools.shutdown()


def test_a_call_that_does_not_parse_is_answered_with_the_parsers_line(server):
    _, sock = server
    torch.manual_seed(0)
    tok = CharTokenizer()
    engine = Engine(Decoder(debug_config(moe=False)).eval(), EngineConfig(max_batch_size=2, block_size=4, max_seq_len=400),
                    eos_id=tok.eos_id)
    tools = ToolTurns(tok, fmt="hermes", specs=[PYTHON_TOOL], max_turns=2, max_output_tokens=60,
                      timeout_s=5, socket_path=sock, limits=Limits(timeout_s=5))
    tools.attach(engine)
    engine.resume([_paused_at(engine, tok, "h", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')])
    gens = _drive(engine, tools)
    (turn, *_) = gens["h"].tool_turns
    assert turn["status"] == "parse_error" and turn["output"].startswith("error: ") and "nope" in turn["output"]
    assert tools.stats["parse_errors"] >= 1 and tools.stats["calls"] == 0
    tools.shutdown()


NOTE = "```python\nimport time; open('n', 'a').write('x\\n'); time.sleep(0.8); print(open('n').read())\n```"
"""A call with a side effect: it appends a line to `n` in the work directory, then (slowly) prints the file."""


def test_a_preempted_call_runs_again_on_the_files_it_found(server):
    """Preemption (seed §5.1.3): a checkpoint taken while a call runs keeps the work directory as that call found
    it; after the job dies, the sample's new sandbox is restored from it and the call runs again: the file holds
    one line per completed call, never the dead run's extra line (and never none of the earlier call's)."""
    srv, sock = server
    torch.manual_seed(0)
    tok = CharTokenizer()
    engine = Engine(Decoder(debug_config(moe=False)).eval(), EngineConfig(max_batch_size=2, block_size=4, max_seq_len=400),
                    eos_id=tok.eos_id)
    limits = Limits(timeout_s=5)
    tools = ToolTurns(tok, fmt="code", specs=[PYTHON_TOOL], max_turns=2, max_output_tokens=40, timeout_s=5,
                      socket_path=sock, limits=limits)
    tools.attach(engine)
    engine.resume([_paused_at(engine, tok, "s", NOTE)])
    engine.step()
    while engine.num_paused:  # the first call runs to its end in a new sandbox and its output is appended
        tools.service(engine)
        tools.wait(0.05)
    (st,) = engine.interrupt()
    assert [t["output"] for t in st.tool_turns] == ["x"]
    # the model's next turn is the same call again (as if it had written it): the sample pauses at it
    call = tok.encode(NOTE)
    st.tokens += call
    st.logprobs += [0.0] * len(call)
    st.policy_versions += [0] * len(call)
    st.paused = True
    engine.resume([st])
    engine.step()
    tools.service(engine)
    deadline = time.monotonic() + 20
    while not any(f.read_text() == "x\nx\n" for f in srv.state_dir.glob("work/*/n")):  # the call has appended
        assert time.monotonic() < deadline, "the second call never wrote its line"
        time.sleep(0.02)
    (held,) = engine.interrupt()  # a checkpoint while the call runs
    kept = tools.workdirs(["s"])["s"]
    with tarfile.open(fileobj=io.BytesIO(kept["archive"]), mode="r:gz") as tar:
        assert tar.extractfile("./n").read() == b"x\n"  # as the pending call found it
    tools.shutdown()  # the job dies: its sandboxes go

    saved = RolloutState.from_bytes(replace(held, workdir=kept).to_bytes())  # what the checkpoint holds
    assert saved.paused and saved.workdir == kept
    lost = _paused_at(engine, tok, "lost", NOTE)
    resumed = ToolTurns(tok, fmt="code", specs=[PYTHON_TOOL], max_turns=2, max_output_tokens=40, timeout_s=5,
                        socket_path=sock, limits=limits)
    resumed.attach(engine)
    resumed.restore_workdirs({"s": saved.workdir, "lost": {"lost": "snapshot: too big"}})
    engine.resume([replace(saved, workdir=None), lost])
    gens = _drive(engine, resumed)
    assert [t["output"] for t in gens["s"].tool_turns] == ["x", "x\nx"]  # one line per completed call
    (failed, *_) = gens["lost"].tool_turns
    assert failed["status"] == "sandbox_failed"
    assert "the work directory was not kept across the preemption: snapshot: too big" in failed["output"]
    resumed.shutdown()


def test_an_evaluation_gets_the_sandboxes_that_parked_samples_held(server):
    """Evaluation while rollouts are parked (PolicyWorker.generate): `suspend` gives the parked samples' sandboxes
    back to the node, keeping their files, so with an admission limit of one the evaluation's call runs at once;
    the parked sample's next call then finds its files again."""
    _, sock = server
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-tool-suspend-"))
    scratch.chmod(0o711)
    one = LocalServer(scratch / "one.sock", scratch / "state", max_sandboxes=1)
    try:
        torch.manual_seed(0)
        tok = CharTokenizer()
        engine = Engine(Decoder(debug_config(moe=False)).eval(), EngineConfig(max_batch_size=2, block_size=4, max_seq_len=400),
                        eos_id=tok.eos_id)
        tools = ToolTurns(tok, fmt="code", specs=[PYTHON_TOOL], max_turns=2, max_output_tokens=40, timeout_s=5,
                          socket_path=one.socket_path, limits=Limits(timeout_s=5), admission_wait_s=2.0)
        tools.attach(engine)
        engine.resume([_paused_at(engine, tok, "s", NOTE)])
        engine.step()
        while engine.num_paused:  # the first call runs and holds the node's one sandbox
            tools.service(engine)
            tools.wait(0.05)
        (st,) = engine.interrupt()  # parked for the evaluation
        assert tools.suspend() == 1
        engine.resume([_paused_at(engine, tok, "eval", NOTE)])
        first = _drive(engine, tools)["eval"].tool_turns[0]
        assert (first["status"], first["output"], first.get("failure")) == ("ok", "x", None)  # admitted, not refused
        call = tok.encode(NOTE)  # the parked sample's next turn calls again: its files came back
        st.tokens += call
        st.logprobs += [0.0] * len(call)
        st.policy_versions += [0] * len(call)
        st.paused = True
        engine.resume([st])
        assert [t["output"] for t in _drive(engine, tools)["s"].tool_turns] == ["x", "x\nx"]
        tools.shutdown()
    finally:
        one.stop()
        shutil.rmtree(scratch, ignore_errors=True)
