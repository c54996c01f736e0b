"""Multi-turn tool calls in the policy worker (issue #16; DESIGN "Tool turns"; seed §5.1.3's split: the sandbox
runs the tools, a scaffold-agnostic layer in the worker orchestrates turns).

The engine pauses a `tool_calls` request when `StopMatcher` says its turn closes a call (rollout/tool_calls.py).
`ToolTurns.service(engine)`, called by the worker between engine steps:
  1. every paused sample without a running call gets one: the turn's text is parsed (`parse_tool_call`); a call
     that does not parse is answered at once with the parser's line (status `parse_error`); a sample that has
     had `tools.max_turns` tool outputs is finished instead (finish reason `max_turns`);
  2. a call runs in the sample's own sandbox (created at its first call on the node's sandbox server,
     `sandbox.socket`; its work directory persists across the sample's calls and is closed when the sample
     ends) on this object's event-loop thread, so the engine keeps decoding the other samples meanwhile;
  3. every finished call's output is formatted (`format_tool_output`), cut to `tools.max_tool_output_tokens`,
     tokenised on its own (`tool_result_tokens`: token in, token out) and appended (`Engine.append`), with its
     record (tool, call, status, exit code, truncation, wall seconds, the output as shown) in
     `Generation.tool_turns`; the sample continues at the next step from its cached KV.
An interrupt for a weight update may fall anywhere: the engine exports paused samples (`paused=True`), a running
call keeps running, and its output is appended after the resume. After a restore from a checkpoint no call is
running for a paused sample, so step 1 runs it again in a new sandbox.
Preemption (seed §5.1.3: rollouts suspended and resumed across preemption): a call must never see its own side
effects twice. Before a call runs in an existing sandbox, the work directory is snapshot (`Sandbox.snapshot`, a
gzip'd tar taken inside the sandbox; a new sandbox starts empty, or from a checkpoint's files, with no snapshot
needed); a checkpoint stores, in each in-flight sample's RolloutState (`workdirs`), that pre-call snapshot for a
sample with a pending call, or a snapshot taken then for one between calls. After `rl resume` (`restore_workdirs`)
the sample's next call first restores its new sandbox from it, so a call that was running when the job died runs
again on the files it saw the first time. A work directory over `Limits.snapshot_mib` cannot be kept: only if a
checkpoint needs it, its sample's next call after the resume fails (`sandbox_failed`, the reason in one line).
Repercussion (seed §5.1.3): a call whose sandbox failed (the server killed it: timeout, memory, cpu, processes,
output_truncated, crashed; or no sandbox: refused after the admission retries, sandbox_error) ends its sample
there, failed (finish reason `tool_failure`; the call kept as an empty tool turn with its `failure` reason);
`tools.on_failure` says how training takes it (rl/algo/repercussion.py). It never stops the job. A call that merely
fails (a non-zero exit) is shown to the model as its output, as is one that does not parse.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rollout.tool_calls import (ToolCall, ToolCallError, ToolSpec, StopMatcher, format_tool_output, parse_tool_call,
                                tool_result_tokens, tool_status)
from rollout.types import Generation, ToolCallPause
from sandbox_client import Limits, SandboxClient
from sandbox_client.records import AdmissionRefused, SandboxError


class ToolTurns:
    def __init__(self, tokenizer, *, fmt: str, specs: Sequence[ToolSpec], max_turns: int, max_output_tokens: int,
                 timeout_s: float, socket_path: str | Path | None, limits: Limits, admission_wait_s: float = 300.0):
        """`socket_path`: the node's sandbox server; None until `use_server` names it (a server the job starts)."""
        self.tok, self.fmt, self.specs = tokenizer, fmt, tuple(specs)
        self.max_turns, self.max_output_tokens, self.timeout_s = max_turns, max_output_tokens, timeout_s
        self.socket_path = None if socket_path is None else Path(socket_path)
        self.limits, self.admission_wait_s = limits, admission_wait_s
        self.matcher = StopMatcher(tokenizer, fmt)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="tool-turns", daemon=True).start()
        self._client: SandboxClient | None = None  # connected at the first call (loop thread)
        self._sandboxes: dict = {}  # sample_id -> Sandbox (loop thread only)
        self._calls: dict[str, concurrent.futures.Future] = {}  # sample_id -> its running call
        self._before: dict[str, asyncio.Future] = {}  # sample_id -> its pending call's pre-call work dir (loop thread)
        self._kept: dict[str, dict] = {}  # sample_id -> work dir from a checkpoint, restored at its next call
        self._closing: list[concurrent.futures.Future] = []  # sandbox closes under way
        self.stats = {"calls": 0, "parse_errors": 0, "sandbox_failed": 0, "max_turns": 0, "tool_failures": 0}

    @classmethod
    def from_recipe(cls, recipe, tokenizer) -> "ToolTurns | None":
        t = recipe.tools
        if t is None:
            return None
        return cls(tokenizer, fmt=t.format, specs=t.specs(), max_turns=t.max_turns,
                   max_output_tokens=t.max_tool_output_tokens, timeout_s=t.timeout_s,
                   socket_path=recipe.sandbox.socket if recipe.sandbox_server == "apart" else None,
                   limits=recipe.sandbox.limits)

    def use_server(self, socket_path: str | Path) -> None:
        """Run calls on the sandbox server at `socket_path` (the node's server the job started: rl/runtime/sandbox_nodes.py);
        call before the first call."""
        self.socket_path = Path(socket_path)

    def attach(self, engine) -> None:
        engine.tool_stop = self.matcher

    # -- between engine steps --------------------------------------------------------------------------
    def service(self, engine) -> list[Generation]:
        """Start calls for new pauses, append finished calls' outputs; returns samples finished here (max_turns, or
        a call whose sandbox failed)."""
        finished = []
        pauses = engine.paused()
        for p in pauses:
            sid = p.sample_id
            if sid in self._calls:
                continue
            if p.tool_turns >= self.max_turns:
                finished.append(engine.finish_paused(sid, "max_turns"))
                self.stats["max_turns"] += 1
                continue
            self._calls[sid] = self._start(p)
        ended = {g.sample_id for g in finished}
        paused = {p.sample_id for p in pauses} - ended  # a call done while its sample is held waits for the resume
        for sid, fut in list(self._calls.items()):
            if fut.done() and sid in paused:
                del self._calls[sid]
                self._before.pop(sid, None)  # the call's effects are now part of the sample
                output, info = fut.result()
                if info.get("failure"):  # repercussion: the sample ends here, failed
                    finished.append(self._fail(engine, sid, output, info))
                    continue
                res = tool_result_tokens(self.tok, output, max_tokens=self.max_output_tokens)
                engine.append(sid, res.tokens, {**info, "output": res.output, "truncated": res.truncated})
        self.close([g.sample_id for g in finished])
        return finished

    def close_all(self) -> None:
        """Every sample was dropped: cancel all calls, close all sandboxes."""
        self.close(list(self._calls))
        self._closing.append(asyncio.run_coroutine_threadsafe(self._close_all(), self._loop))

    def suspend(self) -> int:
        """Free every sandbox this worker holds (an evaluation needs the node's admission slots while the rollouts
        are parked; seed §5.1.3 suspends and resumes rollouts): each sample's work directory is kept as a checkpoint
        keeps it (`workdirs`: before its pending call, or as it is), its call cancelled and its sandbox closed. Its
        next call restores a new sandbox from the kept directory; a cancelled call runs again there, so its side
        effects are not doubled. Returns how many samples' sandboxes were freed."""
        sids = sorted(set(self._calls) | set(asyncio.run_coroutine_threadsafe(self._held_ids(), self._loop).result()))
        if not sids:
            return 0
        kept = self.workdirs(sids)
        for sid in sids:
            fut = self._calls.pop(sid, None)
            if fut is not None:
                fut.cancel()
        asyncio.run_coroutine_threadsafe(self._close(sids), self._loop).result(timeout=60)
        self.restore_workdirs(kept)
        return len(sids)

    async def _held_ids(self) -> list[str]:
        return [*self._sandboxes, *self._before]

    def wait(self, timeout_s: float) -> None:
        """Block until a running call finishes (or `timeout_s`): the engine has nothing else to do."""
        if self._calls:
            concurrent.futures.wait(list(self._calls.values()), timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self, sample_ids: Sequence[str]) -> None:
        """Samples that ended (finished or dropped): close their sandboxes, forget their calls."""
        for sid in sample_ids:
            fut = self._calls.pop(sid, None)
            if fut is not None:
                fut.cancel()
        if sample_ids:
            self._closing = [f for f in self._closing if not f.done()]
            self._closing.append(asyncio.run_coroutine_threadsafe(self._close(list(sample_ids)), self._loop))

    def shutdown(self) -> None:
        """Close every sandbox and the connection; stop the loop thread."""
        for fut in self._calls.values():
            fut.cancel()
        self._calls.clear()
        concurrent.futures.wait(self._closing, timeout=30)
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    # -- preemption: work directories in checkpoints -----------------------------------------------------
    def workdirs(self, sample_ids: Sequence[str]) -> dict[str, dict | None]:
        """For a checkpoint (every engine interrupted): each sample's work directory as its pending call found it
        (the pre-call snapshot), or as it is now when no call is pending; None: no files. `RolloutState.workdir`
        documents the record."""
        return asyncio.run_coroutine_threadsafe(self._workdirs(list(sample_ids)), self._loop).result()

    def restore_workdirs(self, kept: dict[str, dict]) -> None:
        """Work directories from a checkpoint (`workdirs`), by sample id: each sample's next call restores its new
        sandbox from its record first. Call before the samples resume."""
        self._kept.update({sid: w for sid, w in kept.items() if w is not None})

    async def _workdirs(self, sample_ids: list[str]) -> dict[str, dict | None]:
        async def one(sid: str) -> dict | None:
            before = self._before.get(sid)
            if before is not None and not before.cancelled():  # a call is pending: it runs again after a resume
                return await asyncio.shield(before)
            if sid in self._kept:  # restored from a checkpoint, no call since
                return self._kept[sid]
            sb = self._sandboxes.get(sid)
            return None if sb is None else await _snapshot(sb)

        return dict(zip(sample_ids, await asyncio.gather(*(one(sid) for sid in sample_ids))))

    # -- a call ------------------------------------------------------------------------------------------
    def _start(self, p: ToolCallPause) -> concurrent.futures.Future:
        text = self.tok.decode(list(p.response_tokens[p.turn_start:]))
        try:
            call = parse_tool_call(text, self.fmt, self.specs)
        except ToolCallError as e:
            self.stats["parse_errors"] += 1
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result((f"error: {e}", {"tool": None, "call": None, "status": "parse_error", "exit_code": None,
                                             "wall_s": 0.0}))
            return done
        self.stats["calls"] += 1
        return asyncio.run_coroutine_threadsafe(self._run(p.sample_id, call), self._loop)

    async def _run(self, sample_id: str, call: ToolCall) -> tuple[str, dict]:
        t0 = time.monotonic()
        info = {"tool": call.name, "call": call.call_text}
        # the work directory before this call, recorded before the first await (a checkpoint may ask for it
        # at any point of the call): a new sandbox's is the checkpoint's (or nothing), else a snapshot
        sb = self._sandboxes.get(sample_id)
        if sb is None:
            before = asyncio.get_running_loop().create_future()
            before.set_result(self._kept.get(sample_id))
        else:
            before = asyncio.ensure_future(_snapshot(sb))
        self._before[sample_id] = before
        try:
            kept = await before
            if sb is None:
                if kept is not None and "lost" in kept:
                    self._kept.pop(sample_id, None)  # the call after this one starts in an empty sandbox
                    raise SandboxError(f"the work directory was not kept across the preemption: {kept['lost']}")
                if self._client is None:
                    self._client = await SandboxClient.connect(self.socket_path)
                sb = self._sandboxes[sample_id] = await self._client.create_waiting(self.limits, wait_s=self.admission_wait_s)
                if kept is not None and kept["archive"]:  # b"": it was empty, as a new sandbox is
                    await sb.restore(kept["archive"])
                    self._kept.pop(sample_id, None)
            timeout = min(self.timeout_s, self.limits.timeout_s)
            r = await (sb.exec(code=call.source, timeout=timeout) if call.run == "python"
                       else sb.exec(call.source, timeout=timeout))
        except (SandboxError, OSError, asyncio.TimeoutError) as e:
            self.stats["sandbox_failed"] += 1
            self._sandboxes.pop(sample_id, None)
            return (f"[sandbox failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}]",
                    {**info, "status": "sandbox_failed", "exit_code": None, "wall_s": time.monotonic() - t0,
                     "failure": "refused" if isinstance(e, AdmissionRefused) else "sandbox_error"})
        out = format_tool_output(r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"),
                                 reason=r.reason, exit_code=r.exit_code)
        return out, {**info, "status": tool_status(r.reason, r.exit_code), "exit_code": r.exit_code,
                     "wall_s": time.monotonic() - t0, "failure": None if r.reason == "ok" else r.reason}

    def _fail(self, engine, sample_id: str, output: str, info: dict) -> Generation:
        """Repercussion (seed §5.1.3: a crashed environment is a failed trajectory): the sample ends at the call
        (finish reason `tool_failure`), nothing appended; the call stays in its record as an empty tool turn whose
        `failure` names the reason (rl/algo/repercussion.py says what training does with it)."""
        self.stats["tool_failures"] += 1
        g = engine.finish_paused(sample_id, "tool_failure")
        end = len(g.response_tokens)
        turn = {**info, "output": output, "truncated": False, "start": end, "end": end}
        return dataclasses.replace(g, tool_turns=(*g.tool_turns, turn))

    async def _close(self, sample_ids: list[str]) -> None:
        for sid in sample_ids:
            self._before.pop(sid, None)
            self._kept.pop(sid, None)
            sb = self._sandboxes.pop(sid, None)
            if sb is not None:
                try:
                    await sb.close()
                except (SandboxError, OSError):
                    pass  # the server reaps what a dead connection leaves

    async def _close_all(self) -> None:
        self._before.clear()
        self._kept.clear()
        await self._close(list(self._sandboxes))

    async def _shutdown(self) -> None:
        await self._close(list(self._sandboxes))
        if self._client is not None:
            await self._client.close()


async def _snapshot(sb) -> dict:
    """The work directory's record for a checkpoint: its archive, or why it cannot be kept (one line)."""
    try:
        return {"archive": await sb.snapshot()}
    except (SandboxError, OSError, asyncio.TimeoutError) as e:
        return {"lost": str(e).splitlines()[0] if str(e) else type(e).__name__}


def generate_with_tools(engine, tools: ToolTurns | None, requests: Sequence) -> list[Generation]:
    """Run requests to completion on `engine`, serving their tool calls (evaluation); in request order."""
    if tools is None:
        return engine.generate(list(requests))
    engine.add(list(requests))
    out = run_to_completion(engine, tools)
    order = {r.sample_id: i for i, r in enumerate(requests)}
    return sorted(out, key=lambda g: order.get(g.sample_id, len(order)))


def run_to_completion(engine, tools: ToolTurns) -> list[Generation]:
    """Step `engine` until nothing is left, serving tool calls between steps (waiting on them when every
    sample waits for its tool); returns what finished, in finishing order."""
    out: list[Generation] = []
    while True:
        out += tools.service(engine)
        if not engine.has_work():
            return out
        if not engine.runnable():
            tools.wait(0.05)
            continue
        done = engine.step()
        tools.close([g.sample_id for g in done])
        out += done
