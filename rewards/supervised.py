"""Verifier code in a supervised child process (issue 40, class 4): what a user's reward function does (exit,
KeyboardInterrupt, a signal, a hang, forked processes, 50 MiB of prints, a malformed Verdict) costs its sample a 0
with the true reason, never the job, and never more than its time limit.

One child per process (a reward worker's), started on first use and again at once after it dies. It runs in a
session of its own (its own process group), so that a timeout, a death or the job's end kills the group: the
function's forks go with it. A watchdog forked in the child at its start waits for the parent's end of the request
pipe to close (the parent ended, even by SIGKILL) and then kills the group, whatever the child is stuck in.
Its stdout and stderr are one pipe the parent drains: up to `OUTPUT_KEPT` bytes a call are passed on to the
parent's stderr, the rest dropped (one line says how much), so the job's own streams never flood.

Calls cross two pipes of their own (not stdin/stdout, which the function may use): the request, a pickle of
(prepare, fn, args) from the parent (its own code), and replies as JSON, which the parent validates and never
unpickles: a child that runs user code cannot make the parent run any. A reply is `started` (the prepare step, e.g.
importing the function's module, is done: the call's time limit starts there) and then one result: verdicts,
`invalid` (a return value that is no valid Verdict), `exited` (SystemExit) or `raised` (another BaseException that
got past the verifier). `cut_short` (what a SIGTERM'd job asks) stops waiting a second later, whatever runs.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rewards.task import Verdict

START_S = 30.0
"""Time a child may take to start and run a call's prepare step (imports: sympy takes seconds) before the call."""
OUTPUT_KEPT = 64 * 1024
"""Bytes of the child's output passed on to the parent's stderr per call; the rest is dropped."""
REASON_CHARS = 500
"""A verdict's reason is cut to this many characters (it is stored with every sample)."""
MAX_REPLY = 64 * 1024 * 1024
"""A reply frame longer than this is a broken child (the largest batch of verdicts is far smaller)."""
CUT_SHORT_GRACE_S = 1.0
"""After `cut_short`, how long a call still in the child may take."""
_POLL_S = 0.1
"""How often a waiting parent looks at the child's exit and at `cut_short` (a reply wakes it at once)."""
_FRAME = struct.Struct("!I")


@dataclass(frozen=True)
class ChildFailure:
    """A call that produced no valid verdict; `what` completes a sentence ("the reward function " + what)."""

    kind: Literal["crashed", "timed_out", "invalid", "cut_short"]
    """crashed: the child died or a BaseException escaped; timed_out: past the limit (the child is killed);
    invalid: a malformed result; cut_short: the job is stopping (not the function's fault)."""
    what: str
    """e.g. "exited (code 3)", "did not return within 10 s", "returned a malformed Verdict (reward nan is not finite)"."""


@dataclass(frozen=True)
class Invalid:
    """What a function run in the child returns for a result that is no valid Verdict (sent as `invalid`)."""

    what: str


def verdict_problem(v: Any) -> str | None:
    """Why `v` is not a valid Verdict (a finite number reward, a bool `correct`, a str reason, `answered` a bool or
    None), or None when it is. The trainer computes with every one of these: a malformed one would end the job."""
    if not isinstance(v, Verdict):
        return f"{_short(repr(v))}, not a Verdict"
    if isinstance(v.reward, bool) or not isinstance(v.reward, (int, float)):
        return f"a malformed Verdict (reward {_short(repr(v.reward))} is not a number)"
    if not math.isfinite(v.reward):
        return f"a malformed Verdict (reward {v.reward!r} is not finite)"
    if not isinstance(v.correct, bool):
        return f"a malformed Verdict (correct {_short(repr(v.correct))} is not a bool)"
    if not isinstance(v.reason, str):
        return f"a malformed Verdict (reason {_short(repr(v.reason))} is not a str)"
    if v.answered is not None and not isinstance(v.answered, bool):
        return f"a malformed Verdict (answered {_short(repr(v.answered))} is not a bool or None)"
    return None


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the parent's side -------------------------------------------------------------------------------------


_cut_short_at: float | None = None


def cut_short(grace_s: float = CUT_SHORT_GRACE_S) -> None:
    """The job is stopping (SIGTERM): calls still running `grace_s` from now are killed and every later call returns
    `ChildFailure("cut_short")` at once, so a preemption checkpoint never waits behind user code."""
    global _cut_short_at
    _cut_short_at = time.monotonic() + grace_s


def reset_cut_short() -> None:
    """Calls run again (a new job in this process: a RewardWorker's start)."""
    global _cut_short_at
    _cut_short_at = None


class SupervisedChild:
    """The child process verdicts run in (see the module docstring); calls are serialised."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._requests = self._replies = -1  # the parent's ends of the two pipes
        self._kept = 0  # output bytes passed on in the current call
        self._dropped = 0

    # -- lifetime --
    def _start(self) -> None:
        req_r, self._requests = os.pipe()
        self._replies, rep_w = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from rewards.supervised import serve; serve({req_r}, {rep_w})"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(req_r, rep_w),
            start_new_session=True, env=env)
        os.close(req_r)
        os.close(rep_w)
        threading.Thread(target=self._drain, args=(self._proc.stdout,), name="verifier-output", daemon=True).start()
        self._send(pickle.dumps(list(sys.path)))  # the function's module imports as it would here

    def stop(self) -> None:
        """Kill the child's process group (it, its watchdog, whatever the function forked) and reap the child."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for fd in (self._requests, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        self._requests = self._replies = -1

    def _drain(self, stream) -> None:
        """The child's output: up to OUTPUT_KEPT bytes a call to our stderr, the rest counted and dropped."""
        while chunk := stream.read1(65536):
            keep = chunk[: max(0, OUTPUT_KEPT - self._kept)]
            self._kept += len(keep)
            self._dropped += len(chunk) - len(keep)
            if keep:
                sys.stderr.write(keep.decode(errors="replace"))
        stream.close()

    def _note_dropped(self) -> None:
        if self._dropped:
            sys.stderr.write(f"\n[{self._dropped} bytes of the reward function's output dropped: "
                             f"{OUTPUT_KEPT // 1024} KiB a call are kept]\n")
            self._dropped = 0
        self._kept = 0

    # -- a call --
    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float | None,
             prepare: tuple[Callable[..., Any], tuple] | None = None) -> Verdict | list[Verdict] | ChildFailure:
        """`fn(*args)` in the child (after `prepare`, bounded by START_S): its Verdict or list of Verdicts, or a
        ChildFailure. `timeout_s` (None: no limit) counts from the end of `prepare`."""
        with self._lock:
            if _cut_short_at is not None and time.monotonic() >= _cut_short_at:
                return ChildFailure("cut_short", "was cut short: the job is stopping")
            try:
                if self._proc is None:
                    self._start()
                self._kept = 0
                self._send(pickle.dumps((prepare, fn, args)))
                out = self._wait(timeout_s)
            except (BrokenPipeError, EOFError):  # the child died before or while answering
                out = self._death()
            except _Overran as e:
                self.stop()
                out = ChildFailure(*e.args)
            except (ValueError, UnicodeDecodeError) as e:  # a garbled reply: the protocol is lost with this child
                self.stop()
                out = ChildFailure("invalid", f"broke its reply ({_short(str(e), 80)})")
            except BaseException:  # our own failure (or a KeyboardInterrupt here): no call may stay half-read
                self.stop()
                raise
            self._note_dropped()
            return out

    def _send(self, payload: bytes) -> None:
        data = _FRAME.pack(len(payload)) + payload
        while data:
            data = data[os.write(self._requests, data):]

    def _wait(self, timeout_s: float | None) -> Verdict | list[Verdict] | ChildFailure:
        deadline = time.monotonic() + START_S
        limit = f"did not start within {START_S:g} s"
        while True:
            reply = json.loads(self._read(deadline, limit))
            if reply == "started":
                deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
                limit = f"did not return within {timeout_s:g} s" if timeout_s is not None else ""
                continue
            return _decode(reply)

    def _read(self, deadline: float, limit: str) -> bytes:
        size = _FRAME.unpack(self._read_exactly(_FRAME.size, deadline, limit))[0]
        if size > MAX_REPLY:
            raise ValueError(f"a reply of {size} bytes")
        return self._read_exactly(size, deadline, limit)

    def _read_exactly(self, n: int, deadline: float, limit: str) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            now = time.monotonic()
            cut = _cut_short_at
            if cut is not None and now >= cut:
                raise _Overran("cut_short", "was cut short: the job is stopping")
            if now >= deadline:
                raise _Overran("timed_out", limit)
            wait = min(deadline, cut if cut is not None else math.inf) - now
            ready, _, _ = select.select([self._replies], [], [], min(wait, _POLL_S))
            if ready:
                chunk = os.read(self._replies, n - len(buf))
                if not chunk:
                    raise EOFError
                buf += chunk
            elif self._proc is not None and self._proc.poll() is not None:  # died; its forks hold the pipe open
                raise EOFError
        return bytes(buf)

    def _death(self) -> ChildFailure:
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        try:
            self._start()  # at once: the replacement boots while the verdict goes back
        except OSError:
            pass  # the next call tries again
        if code is None:
            return ChildFailure("crashed", "closed its reply pipe")
        if code < 0:
            return ChildFailure("crashed", f"was killed by {signal.Signals(-code).name}")
        return ChildFailure("crashed", f"exited (code {code})")


class _Overran(Exception):
    """A call past its limit or cut short (args: ChildFailure's kind and what)."""


def _decode(reply: Any) -> Verdict | list[Verdict] | ChildFailure:
    """A result reply as Verdicts (each checked again: the child ran user code) or a ChildFailure."""
    if not isinstance(reply, dict) or len(reply) != 1:
        raise ValueError("not a one-key object")
    (key, value), = reply.items()
    if key == "exited":
        return ChildFailure("crashed", f"exited (code {value})" if isinstance(value, int) else
                            f"exited ({_short(str(value), 200)!r})")  # sys.exit("message"): status 1, the message
    if key == "raised":
        return ChildFailure("crashed", f"raised {_short(str(value), 200)}")
    if key == "invalid":
        return ChildFailure("invalid", f"returned {_short(str(value), 200)}")
    if key not in ("one", "many") or not isinstance(value, list):
        raise ValueError(f"unknown reply {_short(key)!r}")
    items = [value] if key == "one" else value
    out: list[Verdict] = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError("a verdict is not [reward, correct, reason, answered]")
        v = Verdict(*item)
        if verdict_problem(v):
            raise ValueError(f"returned {verdict_problem(v)}")
        out.append(Verdict(float(v.reward), v.correct, v.reason[:REASON_CHARS], v.answered))
    return out[0] if key == "one" else out


_child: SupervisedChild | None = None
_child_lock = threading.Lock()


def run_supervised(fn: Callable[..., Any], args: tuple, timeout_s: float | None,
                   prepare: tuple[Callable[..., Any], tuple] | None = None) -> Verdict | list[Verdict] | ChildFailure:
    """`SupervisedChild.call` on this process's child (started on first use, stopped at exit)."""
    global _child
    with _child_lock:
        if _child is None:
            _child = SupervisedChild()
            atexit.register(_child.stop)
        child = _child
    return child.call(fn, args, timeout_s, prepare)


# ---- the child's side --------------------------------------------------------------------------------------


def serve(requests: int, replies: int) -> None:
    """The child's loop: read a request, run it, reply; until the parent closes the request pipe."""
    if os.fork() == 0:
        _watchdog(requests, replies)
    def read(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(requests, n - len(buf))
            if not chunk:
                os._exit(0)  # the parent is done with this child
            buf += chunk
        return buf

    def reply(obj: Any) -> None:
        data = json.dumps(obj).encode()
        data = _FRAME.pack(len(data)) + data
        while data:
            data = data[os.write(replies, data):]

    def frame() -> bytes:
        return read(_FRAME.unpack(read(_FRAME.size))[0])

    sys.path[:] = pickle.loads(frame())
    while True:
        prepare, fn, args = pickle.loads(frame())
        try:
            if prepare is not None:
                prepare[0](*prepare[1])
            reply("started")
            out = fn(*args)
        except SystemExit as e:
            out = _Exited(e.code if e.code is not None else 0)
        except BaseException as e:  # noqa: BLE001 - what got past the verifier's own handling: the sample's reason
            out = _Raised(f"{type(e).__name__}" + (f": {e}" if str(e) else ""))
        for stream in (sys.stdout, sys.stderr):  # its prints belong to this call's output
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a stream the function replaced or closed
                pass
        reply(_encode(out))


@dataclass(frozen=True)
class _Exited:
    code: Any


@dataclass(frozen=True)
class _Raised:
    text: str


def _encode(out: Any) -> Any:
    if isinstance(out, _Exited):
        return {"exited": out.code if isinstance(out.code, int) else str(out.code)}
    if isinstance(out, _Raised):
        return {"raised": out.text}
    if isinstance(out, Invalid):
        return {"invalid": out.what}
    many = isinstance(out, list)
    for v in out if many else [out]:
        problem = verdict_problem(v)
        if problem:
            return {"invalid": problem}
    items = [[float(v.reward), v.correct, v.reason[:REASON_CHARS], v.answered] for v in (out if many else [out])]
    return {"many": items} if many else {"one": items[0]}


def _watchdog(requests: int, replies: int) -> None:
    """In a process forked at the child's start (same process group): wait until no one holds the request pipe's
    write end (the parent ended, however), then kill the group. Holds no pipe end the parent reads."""
    try:
        os.close(replies)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        poll = select.poll()
        poll.register(requests, 0)  # POLLHUP only: pending requests are the child's to read
        while not poll.poll():
            pass
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)
