"""A warm interpreter per sandbox (a fork server, like multiprocessing's "forkserver" or Android's zygote): the
sandbox's first `python3 -c CODE [ARG...]` starts ONE long-lived `python3` through the same launcher and backend
as any exec (the same cgroups, uid, rlimits and, with bwrap, the same namespaces), and every Python call of the
sandbox from then on is a child that this interpreter forks. A spawn costs ~16 ms of CPU on a 2-core machine
(interpreter start-up, namespaces); a fork of a warm interpreter a few. Anything but that argv shape (a shell
command, `python3 FILE`, `python3 -u ...`, the server's own cat/tar) takes the cold path, a spawn, as before.

- Pristine state: a child is forked from the interpreter's state as it was before its first call; nothing of a
  call runs in the interpreter itself, so no call sees another's globals, imports or files open. The
  interpreter pre-imports nothing that user code can see: it notes `sys.modules`, `sys.path`,
  `sys.path_importer_cache` and `__main__`'s namespace first thing, and a child puts all four back before it
  runs the call (what the interpreter imported for itself, `_socket`, `ctypes`, `gc`, `atexit`, is gone from the
  child's `sys.modules`). The child also gets fresh `sys.stdin/stdout/stderr` built the way the interpreter's start-up
  builds them, over the call's own pipes, `sys.argv == ['-c', ARG...]`, the session a cold call has (bwrap:
  init's, the one `--new-session` made; the process backend: a session of its own) and Python's SIGINT handler.
- Pipes: per call the server makes pipes for stdout and stderr (stdin too when the call has input, else the
  child opens /dev/null, as a cold call gets) and one for the request (the argv, NUL-separated), and passes their
  far ends to the interpreter with SCM_RIGHTS over a SOCK_SEQPACKET socket pair whose one end the interpreter
  inherited through the launcher and bwrap (a file descriptor crosses the namespaces like any inherited one).
  The interpreter closes its copies after the fork, so the server's readers see EOF when the call (and what it
  started) has ended.
- Exit status: the interpreter waits for the child (`waitpid`) and sends the wait status back over the socket
  (`exit STATUS CPU_MS`); the server turns it into what a cold spawn would have reported (bwrap: 128 + N for a
  signal N). The child ends as a fresh interpreter does: an uncaught exception printed by `sys.excepthook`
  without the interpreter's own frame (the traceback a fresh `python3 -c` prints) and exit 1, `SystemExit`'s
  code or message as Python handles it, an uncaught KeyboardInterrupt dies of SIGINT; then what Py_FinalizeEx
  does that a call can see, in its order: non-daemon threads joined, atexit run, std streams flushed (exit 120
  if that fails), `__main__`'s names set to None as module teardown does (an unclosed file flushes, `__del__`
  runs) and cycles collected,
  streams flushed again, `_exit`. Tearing every module down is skipped (~4 ms a call, most of it copying the
  interpreter's pages on write): an object only that teardown would finalize is not. The interpreter
  `gc.freeze()`s its own objects, so a child's collections neither scan nor copy them.
- Strays: with bwrap the interpreter is the pid namespace's init (`--as-pid-1`), so every orphan of a call,
  double-forked daemons included, becomes its child, and after each call it `kill(-1, SIGKILL)`s (an init's
  kill(-1) reaches every other process of its namespace and only those) and reaps until it has no child left:
  nothing of a call survives into the next, as when each call's namespace died with it. The server then checks
  the sandbox's cgroup: anything beside the processes it held before the call retires the interpreter. As init,
  the interpreter cannot be killed from inside (the kernel drops a signal to a namespace's init that has no
  handler, SIGKILL included), and it ignores SIGINT (children get Python's handler back). The process backend
  (WEAK, no namespaces) kills the call's process group after it ends, which is what a cold call's leftovers get.
- Limits: the call runs under the server's supervision exactly as a cold one (runner.py): wall-clock timeout,
  CPU seconds from the cgroup (RLIMIT_CPU behind it: a forked child's counter starts at 0), output caps,
  memory and process count from the cgroup and the rlimits the interpreter inherited. On any kill (timeout, CPU,
  output cap, leftover) the server kills the interpreter's whole process tree (the launcher's process group:
  the outer bwrap, whose death takes the namespace; with the process backend, the call's session too) and the
  next call starts a fresh interpreter. It is retired as well when it died, when strays remain, and when its
  own CPU time passes half of `Limits.cpu_s` (RLIMIT_CPU counts the interpreter's fork work too).
- Integrity: the interpreter makes itself non-dumpable (prctl PR_SET_DUMPABLE 0, so a call cannot ptrace it or
  write its /proc/1/mem even where Yama allows same-uid ptrace); each child sets itself dumpable again.
- What differs from a cold call: string hashing (PYTHONHASHSEED: drawn once per interpreter, shared by its
  calls) and the address-space layout (ASLR, also once per interpreter); `os.getpid()` counts up across calls
  instead of being 2 every time; the interpreter's ~10 MB stay resident in the sandbox's memory cgroup between
  calls; module teardown at exit (above); `gc.get_freeze_count()` is not 0; with the process backend a call
  that kills the interpreter (its parent there) ends as `crashed`. A sandbox runs one warm call at a time; a Python
  call that comes while one runs takes the cold path (and its processes, seen in the cgroup when the warm call
  ends, retire the interpreter: a spawn more, nothing wrong).
- Off: `SandboxServer(warm_interpreter=False)`, `serve --no-warm-interpreter`, recipe `sandbox.warm_interpreter:
  false`; per sandbox, `client.create(warm=False)`, which `run_batch` (the verifiers' one command per sandbox) says:
  a sandbox of one call pays a spawn either way, and the interpreter's fork and ctypes on top (~5 ms of CPU). An interpreter that does not start (no ctypes in the sandbox's Python, say) turns the warm path off for
  that sandbox, with a line in the command log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from sandbox_client.backends import Backend
from sandbox_client.processes import Children, kill_group

ZYGOTE_START_S = 30.0
"""How long an interpreter may take to say it is ready before the call runs cold instead."""
ZYGOTE_NAME = "<warm interpreter>"
WRAPPER = (f"exec(compile(__import__('sys').argv[1], {ZYGOTE_NAME!r}, 'exec'), {{'FRESH_MAIN': dict(globals()), "
           f"'ZYGOTE_NAME': {ZYGOTE_NAME!r}}})")
"""The `-c` code of the interpreter: keeps `__main__`'s namespace as a fresh `python3 -c` has it (no name bound
first) and runs ZYGOTE in a namespace of its own."""
ZYGOTE = r'''
import sys
BASE_MODULES = dict(sys.modules)
BASE_FINDERS = dict(sys.path_importer_cache)
BASE_PATH = list(sys.path)
import atexit, ctypes, gc, io, os, _signal, _socket

LIBC = ctypes.CDLL(None, use_errno=True)
if LIBC.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: no ptrace of this process by a call
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
CTL = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, int(sys.argv[2]))
NS_INIT = os.getpid() == 1
UNBUFFERED = sys.__stdout__.write_through  # -u or PYTHONUNBUFFERED (sys.flags does not say)
FDS_SPACE = _socket.CMSG_SPACE(4 * 4)


def received_fds(ancdata):
    fds = []
    for level, kind, data in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    return fds


def sweep(pid):
    if NS_INIT:  # every other process of the namespace; reap until none is left
        while True:
            try:
                os.kill(-1, 9)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    try:
        os.killpg(pid, 9)
    except OSError:
        pass


SIGINT_AT_START = _signal.getsignal(_signal.SIGINT)  # Python's handler, or SIG_IGN where the launcher ignored SIGINT
                                                     # (a background job's): a fresh interpreter's, given back to calls


def serve():
    gc.freeze()  # what is here now stays out of every child's collections: no copy-on-write of it by the collector
    CTL.send(b"ready")
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    while True:
        msg, ancdata, _, _ = CTL.recvmsg(16, FDS_SPACE)
        fds = received_fds(ancdata)
        if msg != b"run" or len(fds) not in (3, 4):
            os._exit(0 if not msg else 3)  # the server closed the socket (or spoke nonsense)
        pid = os.fork()
        if pid == 0:
            return fds
        for fd in fds:
            os.close(fd)
        CTL.send(b"pid %d" % pid)
        status = os.waitpid(pid, 0)[1]
        sweep(pid)
        t = os.times()
        CTL.send(b"exit %d %d" % (status, round((t.user + t.system) * 1000)))


def std_stream(fd, old):
    """A std stream over `fd` as the interpreter's start-up makes one (Python/pylifecycle.c create_stdio)."""
    write, buffered = fd != 0, not UNBUFFERED
    buffering = 0 if write and not buffered else -1
    buf = io.open(fd, "wb" if write else "rb", buffering, None, None, None, False)
    raw = buf.raw if buffering else buf
    raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]
    stream = io.TextIOWrapper(buf, old.encoding, old.errors, "\n", buffered and (raw.isatty() or fd == 2),
                              not buffered)
    stream.mode = "w" if write else "r"
    return stream


def become_call(fds):
    CTL.close()
    if not NS_INIT:  # a cold call heads its own session there; under bwrap it is in init's, as here
        os.setsid()
    request, out, err = fds[0], fds[-2], fds[-1]
    stdin = fds[1] if len(fds) == 4 else os.open(os.devnull, os.O_RDONLY)
    for target, fd in ((0, stdin), (1, out), (2, err)):
        os.dup2(fd, target)
    for fd in {stdin, out, err} - {0, 1, 2}:
        os.close(fd)
    chunks = []
    while chunk := os.read(request, 1 << 16):
        chunks.append(chunk)
    os.close(request)
    argv = [os.fsdecode(a) for a in b"".join(chunks).split(b"\0")]
    _signal.signal(_signal.SIGINT, SIGINT_AT_START)
    LIBC.prctl(4, 1, 0, 0, 0)
    sys.stdin = sys.__stdin__ = std_stream(0, sys.__stdin__)
    sys.stdout = sys.__stdout__ = std_stream(1, sys.__stdout__)
    sys.stderr = sys.__stderr__ = std_stream(2, sys.__stderr__)
    for name in [n for n in sys.modules if n not in BASE_MODULES]:
        del sys.modules[name]
    sys.modules.update(BASE_MODULES)
    sys.path_importer_cache.clear()
    sys.path_importer_cache.update(BASE_FINDERS)
    sys.path[:] = BASE_PATH
    sys.argv = ["-c", *argv[3:]]
    if hasattr(sys, "orig_argv"):  # Python 3.10+
        sys.orig_argv = argv
    main = sys.modules["__main__"].__dict__
    main.clear()
    main.update(FRESH_MAIN)
    code, interrupted = 0, False
    try:
        exec(command_code(argv[2]), main)
    except SystemExit as e:
        code = exit_status(e.code)
    except BaseException as e:
        tb = e.__traceback__  # from the call's code on, as a fresh interpreter prints it
        while tb is not None and tb.tb_frame.f_code.co_filename == ZYGOTE_NAME:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    finalize(main, code, interrupted)


def command_code(command):
    """`python3 -c`'s code object (Modules/main.c pymain_run_command: the command and a newline, named "<string>");
    from Python 3.13 on, its source registered with linecache as the interpreter does for -c (Python/pythonrun.c
    run_mod), so that tracebacks show its lines."""
    source = command + "\n"
    code = compile(source, "<string>", "exec", dont_inherit=True)
    linecache = sys.modules.get("linecache")
    register = getattr(linecache, "_register_code", None)
    if sys.version_info >= (3, 13) and register is not None:  # keyed as this interpreter's own -c was
        register("<string>" if "<string>" in linecache.cache else code, source, "<string>")
    return code


def exit_status(value):
    """What a fresh interpreter exits with for SystemExit(value) (Python/pythonrun.c _Py_HandleSystemExit)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value if -2**63 <= value < 2**63 else -1
    print(value, file=sys.stderr)
    return 1


def finalize(main, code, interrupted):
    """What Py_FinalizeEx does that a call can observe, in its order: join non-daemon threads, run atexit, flush the
    std streams, clear __main__'s names (files it holds close and flush, __del__ runs) and collect cycles, flush
    again; then _exit. The rest (tearing every module down, ~4 ms that COW-copies the interpreter's pages) is
    skipped: an object that only module teardown would finalize is not."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    (sys.modules.get("atexit") or atexit)._run_exitfuncs()  # the call's own import of it (Python < 3.10: its own list)
    if not flush_std():
        code = 120
    for pass_ in (1, 2):  # as Objects/moduleobject.c _PyModule_ClearDict: _names first, __builtins__ kept
        for name in list(main):
            if (isinstance(name, str) and name != "__builtins__"
                    and (name.startswith("_") and not name.startswith("__")) == (pass_ == 1)):
                main[name] = None
    gc.collect()
    if not flush_std():
        code = 120
    if interrupted:  # as Python's exit after an uncaught KeyboardInterrupt: die of SIGINT
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
        os.kill(os.getpid(), _signal.SIGINT)
    os._exit(code & 0xFF)


def flush_std():
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            ok = False
    return ok


try:
    become_call(serve())
except BaseException:  # a failure of this code itself (never the call's): said, and no interpreter shutdown after it
    sys.excepthook(*sys.exc_info())
os._exit(70)
'''


def warm_argv(argv: list[str]) -> bool:
    """Whether a call of `argv` can run warm: `python3 -c CODE [ARG...]`, the shape of every Python tool call
    (records.command_argv)."""
    return len(argv) >= 3 and argv[0] == "python3" and argv[1] == "-c"


class WarmUnavailable(RuntimeError):
    """An interpreter that did not start; the message is one line."""


class _PipeEnd(asyncio.StreamReaderProtocol):
    """A read pipe's protocol that also says when the pipe closed."""

    def __init__(self, reader: asyncio.StreamReader):
        super().__init__(reader)
        self.closed = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc):
        super().connection_lost(exc)
        if not self.closed.done():
            self.closed.set_result(None)


class WarmInterpreter:
    """One sandbox's warm interpreter as the server holds it: its launcher process, its end of the socket pair,
    whether a call runs in it, and whether it must go (`retire`)."""

    def __init__(self, proc: asyncio.subprocess.Process, ctl: socket.socket, children: Children, ns_init: bool):
        self.proc, self.ctl, self.children, self.ns_init = proc, ctl, children, ns_init
        self.busy = False
        self.dead = False
        """It ended, or was killed, or must not serve another call."""
        self.baseline: set[int] | None = None
        """The pids of its cgroup while it waits for a call (None: no cgroup)."""
        self.cpu_ms = 0
        """Its own CPU time (the forks and waits), as it last said."""

    @classmethod
    async def start(cls, argv_of: Callable[[list[str]], tuple[list[str], str, dict[str, str]]], backend: Backend,
                    children: Children, procs_file: Path | None) -> "WarmInterpreter":
        """`argv_of(argv)`: the backend's (host argv, cwd, env) for the interpreter's argv; `procs_file`: the
        sandbox cgroup's procs file (None: no cgroup)."""
        ctl, inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            host, cwd, env = argv_of(["python3", "-c", WRAPPER, ZYGOTE, str(inner.fileno())])
            proc = await children.spawn(host, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                        stderr=asyncio.subprocess.DEVNULL, cwd=cwd, env=env, start_new_session=True,
                                        pass_fds=(inner.fileno(),))
        except BaseException:
            ctl.close()
            raise
        finally:
            inner.close()
        ctl.setblocking(False)
        warm = cls(proc, ctl, children, backend.strong)
        try:
            ready = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ctl, 64), ZYGOTE_START_S)
        except (asyncio.TimeoutError, OSError) as e:
            await warm.retire()
            raise WarmUnavailable(f"the warm interpreter did not start ({type(e).__name__})") from None
        if ready != b"ready":
            await warm.retire()
            raise WarmUnavailable(f"the warm interpreter did not start (exit {proc.returncode})")
        if procs_file is not None:
            warm.baseline = pids_of(procs_file)
        return warm

    async def call(self, argv: list[str], stdin: bytes, strong: bool) -> "WarmCall":
        """Hand the interpreter one call; the call's pipes, status and kill."""
        loop = asyncio.get_running_loop()
        request_r, request_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin else (None, None)
        far = [request_r, *([in_r] if stdin else []), out_w, err_w]
        try:
            socket.send_fds(self.ctl, [b"run"], far)
        except OSError:
            for fd in (request_w, out_r, err_r, *([in_w] if stdin else [])):
                os.close(fd)
            raise
        finally:
            for fd in far:
                os.close(fd)
        call = WarmCall(self, strong)
        await call.connect(loop, out_r, err_r)
        call.feeders = [asyncio.create_task(_write_fd(request_w, b"\0".join(map(os.fsencode, argv))))]
        if stdin:
            call.feeders.append(asyncio.create_task(_write_fd(in_w, stdin)))
        return call

    def kill(self) -> None:
        """SIGKILL its whole tree: the launcher's process group (with bwrap the outer bwrap, whose death takes the
        namespace and all in it)."""
        self.dead = True
        kill_group(self.proc.pid)

    async def retire(self) -> None:
        """Kill it (if it still runs) and wait for its launcher. The socket is closed only while no call reads it: a
        call that runs reads EOF (its interpreter is dead) and retires it again when it ends (closing an fd the
        event loop still watches would let a later socket or pipe with the same number take its reads)."""
        self.kill()
        if not self.busy and self.ctl.fileno() != -1:
            self.ctl.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)
        if self.proc.returncode is not None:
            self.children.done(self.proc)


class WarmCall:
    """One call running in a warm interpreter, with the face runner.py supervises: stdout, stderr, returncode,
    wait(), kill()."""

    def __init__(self, warm: WarmInterpreter, strong: bool):
        self.warm, self.strong = warm, strong
        self.stdout = asyncio.StreamReader(limit=1 << 20)
        self.stderr = asyncio.StreamReader(limit=1 << 20)
        self.returncode: int | None = None
        self.child_pid: int | None = None
        self.feeders: list[asyncio.Task] = []
        self._pipes: list[_PipeEnd] = []
        self._transports = []

    async def connect(self, loop, out_r: int, err_r: int) -> None:
        for fd, reader in ((out_r, self.stdout), (err_r, self.stderr)):
            proto = _PipeEnd(reader)
            transport, _ = await loop.connect_read_pipe(lambda p=proto: p, os.fdopen(fd, "rb", buffering=0))
            self._pipes.append(proto)
            self._transports.append(transport)

    async def wait(self) -> int:
        """The exit status as a cold spawn reports it, once the interpreter said so and both pipes closed; a dead
        interpreter's call reads as killed (-SIGKILL)."""
        loop = asyncio.get_running_loop()
        while self.returncode is None:
            try:
                msg = await loop.sock_recv(self.warm.ctl, 64)
            except OSError:
                msg = b""
            word, *values = msg.split()
            if word == b"pid":
                self.child_pid = int(values[0])
            elif word == b"exit":
                code = os.waitstatus_to_exitcode(int(values[0]))
                self.warm.cpu_ms = int(values[1])
                self.returncode = 128 - code if code < 0 and self.strong else code
            else:  # EOF: the interpreter is gone (killed, or out of memory)
                self.warm.dead = True
                self.returncode = -signal.SIGKILL
        await asyncio.gather(*(p.closed for p in self._pipes))
        return self.returncode

    def kill(self) -> None:
        self.warm.kill()
        if not self.warm.ns_init and self.child_pid is not None:  # process backend: the call's own session
            kill_group(self.child_pid)

    def close(self) -> None:
        for t in self.feeders:
            t.cancel()
        for transport in self._transports:
            transport.close()


async def _write_fd(fd: int, data: bytes) -> None:
    """Write `data` into the pipe `fd` without blocking the loop, then close it; a reader that went away is no
    error (a call need not read its stdin)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(fd, lambda: writable.done() or writable.set_result(None))
                try:
                    await writable
                finally:
                    loop.remove_writer(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        os.close(fd)


def pids_of(procs_file: Path) -> set[int]:
    """The pids a cgroup's procs file lists (empty when it cannot be read)."""
    with contextlib.suppress(OSError):
        return {int(p) for p in procs_file.read_text().split()}
    return set()
