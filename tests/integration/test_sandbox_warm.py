"""The warm interpreter (sandbox_client/warm.py) against the cold path, real processes and real servers: a server
with it and one without, same backend, run the same snippets; every observable of a call (stdout, stderr, exit
code, signal, reason, truncation) must be equal, and state must not cross calls on the warm one. Each check is
shown to fail on an interpreter that runs calls without forking (`test_a_reused_interpreter_is_caught`).

Both backends; bwrap skips where bubblewrap is missing (and fails under CI=true, as the hostile tests do)."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandbox_client import ExecResult, ExecSpec, Limits, LocalServer, SandboxClient, SandboxError
from sandbox_client.hostile import CHECKOUT
from sandbox_client.launch import server_pid
from sandbox_client.processes import Children, uid_processes
from sandbox_client.warm import WarmInterpreter

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LIMITS = Limits(memory_mib=256, cpu_s=1.0, max_processes=32, timeout_s=5.0, output_bytes=64 << 10)
ENVIRONMENT = ("import sys\nprint(sorted(sys.modules))\nprint(sorted(globals()), __name__, __doc__, __spec__)\n"
               "print(sys.argv, sys.orig_argv, sys.path)\n"
               "print([(s.name, s.mode, s.seekable(), s.line_buffering, s.write_through, s.encoding, s.errors)"
               " for s in (sys.stdin, sys.stdout, sys.stderr)])\n"
               "print(sys.stdin is sys.__stdin__, sys.stdout is sys.__stdout__, sys.stderr is sys.__stderr__)\n"
               "import os, stat, signal\nprint(sorted(os.listdir('/proc/self/fd')), [(os.get_blocking(f),"
               " stat.S_IFMT(os.fstat(f).st_mode)) for f in (0, 1, 2)], signal.getsignal(signal.SIGINT),"
               " signal.getsignal(signal.SIGPIPE), signal.pthread_sigmask(signal.SIG_BLOCK, []))\n")
BWRAP_ONLY = "import os\nprint(os.getppid(), os.getcwd(), os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())\n"
DAEMON = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
          "        for fd in (0, 1, 2):\n            os.close(fd)\n        time.sleep(0.5)\n"
          "        open('daemon-was-here', 'w').write('x')\n        time.sleep(300)\n    os._exit(0)\n"
          "print('daemon started')\n")
AFTER_DAEMON = ("import os, time\ntime.sleep(1.0)\nprint(os.path.exists('daemon-was-here'),"
                " len([p for p in os.listdir('/proc') if p.isdigit()]))\n")
LEAVE_STATE = ("import sys, json\nX = 1\njson.leaked = 1\nsys.leaked = 1\nimport collections\n"
               "open('left.txt', 'w').write('kept')\nprint('set')\n")
READ_STATE = ("import sys\nprint('X' in globals(), hasattr(sys, 'leaked'), 'json' in sys.modules,"
              " 'collections' in sys.modules, open('left.txt').read())\n")
CLEAN_STATE = "False False False False kept\n"

# name -> (exec arguments, on which backends)
CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "print": ({"code": "print('hi')"}, ("bwrap", "process")),
    "stdin_echo": ({"code": "import sys; sys.stdout.write(sys.stdin.read().upper())", "stdin": b"echo me\n"},
                   ("bwrap", "process")),
    "exit_3": ({"code": "import sys; sys.exit(3)"}, ("bwrap", "process")),
    "exit_message": ({"code": "import sys; print('out'); sys.exit('bye')"}, ("bwrap", "process")),
    "raise": ({"code": "def f():\n    raise ValueError('boom')\nf()"}, ("bwrap", "process")),
    "syntax_error": ({"code": "def f(:"}, ("bwrap", "process")),
    "killed_by_signal": ({"code": "import os, signal; print('x', flush=True); os.kill(os.getpid(), signal.SIGTERM)"},
                         ("bwrap", "process")),
    "argv": ({"command": ["python3", "-c", "import sys; print(sys.argv)", "a", "b c"]}, ("bwrap", "process")),
    "atexit_and_threads": ({"code": "import atexit, threading, time\natexit.register(print, 'atexit ran')\n"
                                    "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()"},
                           ("bwrap", "process")),
    "exit_status_wraps": ({"code": "import sys; sys.exit(-1)"}, ("bwrap", "process")),
    "keyboard_interrupt": ({"code": "print('before', flush=True)\nraise KeyboardInterrupt"}, ("bwrap", "process")),
    "finalizers_at_exit": ({"code": "import sys\nclass A:\n    def __del__(self):\n        print('del', self.n)\n"
                                    "a = A(); a.n = 1\nb = A(); b.n = 2; b.me = b\nf = open('unclosed.txt', 'w')\n"
                                    "f.write('flushed at exit')\nsys.stdout.write('no newline')"}, ("bwrap", "process")),
    "environment": ({"code": ENVIRONMENT}, ("bwrap", "process")),
    "environment_stdin": ({"code": ENVIRONMENT, "stdin": b"x"}, ("bwrap", "process")),
    "process_tree": ({"code": BWRAP_ONLY}, ("bwrap",)),
    "infinite_loop_timeout": ({"code": "import time\nwhile True:\n    time.sleep(0.01)", "timeout": 1.0},
                              ("bwrap", "process")),
    "cpu_burner": ({"code": "print('burn', flush=True)\nwhile True:\n    pass", "timeout": 4.0}, ("bwrap", "process")),
    "huge_output": ({"code": "import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * 65536)"},
                    ("bwrap", "process")),
}


def _settled(uid: int | None, within_s: float = 2.0) -> list[int]:
    """The uid's live processes once SIGKILLed ones had `within_s` to go (a pid namespace ends a moment after its
    init)."""
    end = time.monotonic() + within_s
    while (left := uid_processes(uid)) and time.monotonic() < end:
        time.sleep(0.01)
    return left


def _observed(r: ExecResult) -> tuple:
    return r.stdout, r.stderr, r.exit_code, r.signal, r.reason, r.stdout_truncated, r.stderr_truncated


@pytest.fixture(scope="module", params=["bwrap", "process"])
def servers(request):
    """(backend, cold server, warm server)."""
    backend = request.param
    if backend == "bwrap" and shutil.which("bwrap") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but bubblewrap is missing")
        pytest.skip("bubblewrap is not installed")
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-warm-"))  # sandbox uids traverse it
    scratch.chmod(0o711)
    cold = LocalServer(scratch / "cold.sock", scratch / "cold.state", backend=backend, warm_interpreter=False)
    try:
        warm = LocalServer(scratch / "warm.sock", scratch / "warm.state", backend=backend)
    except BaseException:
        cold.stop()
        raise
    yield backend, cold, warm
    warm.stop()
    cold.stop()
    shutil.rmtree(scratch, ignore_errors=True)


async def _one(socket_path: Path, args: dict) -> tuple[ExecResult, dict]:
    async with await SandboxClient.connect(socket_path) as client:
        async with await client.create(LIMITS) as sb:
            await sb.exec(code="pass")  # the sandbox's first Python call starts its warm interpreter
            r = await sb.exec(**args)
            follow = await sb.exec(code="import os; print('next', os.path.exists('unclosed.txt') and open('unclosed.txt').read())")
        return r, {"follow": _observed(follow), "warm": (await client.info())["warm"]}


@pytest.mark.parametrize("case", list(CASES))
def test_warm_and_cold_calls_are_alike(servers, case):
    backend, cold, warm = servers
    args, backends = CASES[case]
    if backend not in backends:
        pytest.skip(f"{case}: the {backend} backend's processes see the host's pids and paths")
    (c, c_more), (w, w_more) = asyncio.run(_one(cold.socket_path, args)), asyncio.run(_one(warm.socket_path, args))
    if case == "huge_output":  # where the cap cut the stream is the only freedom
        assert len(c.stdout) == len(w.stdout) == LIMITS.output_bytes
    assert _observed(c) == _observed(w), f"cold {c}\nwarm {w}"
    left = b"flushed at exit" if case == "finalizers_at_exit" else b"False"
    assert c_more["follow"] == w_more["follow"] == (b"next " + left + b"\n", b"", 0, None, "ok", False, False)
    assert c_more["warm"]["calls"] == 0 and w_more["warm"]["calls"] >= 3  # the warm server did run them warm
    expected = {"infinite_loop_timeout": "timeout", "cpu_burner": "cpu", "huge_output": "output_truncated",
                "killed_by_signal": "crashed", "keyboard_interrupt": "crashed"}.get(case, "ok")
    assert w.reason == expected, w
    if case == "finalizers_at_exit":  # not merely equal: both ran every finalizer
        assert w.stdout == b"no newlinedel 1\ndel 2\n", w


async def _session(socket_path: Path, codes: list[str]) -> tuple[list[ExecResult], dict]:
    async with await SandboxClient.connect(socket_path) as client:
        async with await client.create(LIMITS) as sb:
            results = [await sb.exec(code=code) for code in codes]
        return results, (await client.info())["warm"]


def test_files_persist_and_interpreter_state_does_not(servers):
    """A file written in the work directory is there for the next call; a module-level global, an attribute set on
    an imported module, a module imported, are not (each call forks from the pristine interpreter)."""
    backend, cold, warm = servers
    for server in (cold, warm):
        results, _ = asyncio.run(_session(server.socket_path, [LEAVE_STATE, READ_STATE, READ_STATE]))
        assert [r.stdout_text for r in results] == ["set\n", CLEAN_STATE, CLEAN_STATE], results


def test_a_daemon_does_not_survive_its_call(servers):
    """A double-forked daemon that closed its output: gone with its call (cold: its pid namespace dies; warm: the
    interpreter, the namespace's init, kills everything else after each call), so it never writes its file, and
    the next call sees two processes (init and itself). The interpreter's own sweep does it: the server's cgroup
    check behind it (strays retire the interpreter) has nothing to do. The weak backend has no namespace: skipped."""
    backend, cold, warm = servers
    if backend != "bwrap":
        pytest.skip("the process backend's setsid daemons outlive their call, cold or warm (as always)")
    outs, retired = {}, {}
    for name, server in (("cold", cold), ("warm", warm)):
        before = asyncio.run(_session(server.socket_path, []))[1]
        results, after = asyncio.run(_session(server.socket_path, [DAEMON, AFTER_DAEMON]))
        outs[name] = [(r.stdout_text, r.reason) for r in results]
        retired[name] = after["retired"] - before["retired"]
    assert outs["cold"] == outs["warm"] == [("daemon started\n", "ok"), ("False 2\n", "ok")], outs
    assert retired == {"cold": 0, "warm": 0}


def test_a_killed_call_retires_the_interpreter_and_the_next_starts_fresh(servers):
    backend, cold, warm = servers
    codes = ["X = 1\nimport time\ntime.sleep(60)", "print('X' in globals())", "print('again')"]

    async def run():
        async with await SandboxClient.connect(warm.socket_path) as client:
            before = (await client.info())["warm"]
            async with await client.create(LIMITS) as sb:
                results = [await sb.exec(code=codes[0], timeout=0.5)]
                left = _settled(sb.host_uid)  # the interpreter's tree died with the call
                results += [await sb.exec(code=codes[1]), await sb.exec(code=codes[2])]
            after = (await client.info())["warm"]
        return results, {k: after[k] - before[k] for k in after}, left

    results, delta, left = asyncio.run(run())
    assert left == []
    assert [r.reason for r in results] == ["timeout", "ok", "ok"]
    assert [r.stdout_text for r in results[1:]] == ["False\n", "again\n"]
    assert delta == {"starts": 2, "calls": 3, "retired": 1}, delta


def test_warm_calls_in_one_sandbox_run_concurrently(servers):
    """A Python call that comes while the interpreter serves another runs cold beside it: both finish, right."""
    backend, cold, warm = servers

    async def run():
        async with await SandboxClient.connect(warm.socket_path) as client:
            async with await client.create(LIMITS) as sb:
                await sb.exec(code="pass")
                return await asyncio.gather(*(sb.exec(code=f"import time; time.sleep(0.3); print({i})") for i in range(3)))

    assert [r.stdout_text for r in asyncio.run(run())] == ["0\n", "1\n", "2\n"]


def test_closing_a_sandbox_during_a_warm_call_disturbs_no_other(servers):
    """A client that goes away while its sandbox runs a warm call: the server kills that interpreter at once (its
    connection's requests end within a second, not at the call's timeout), and another sandbox's calls, whose new
    pipes and sockets reuse the freed descriptor numbers, run right."""
    backend, cold, warm = servers

    async def run():
        async with await SandboxClient.connect(warm.socket_path) as b:
            other = await b.create(LIMITS)
            await other.exec(code="pass")
            for _ in range(3):
                a = await SandboxClient.connect(warm.socket_path)
                doomed = await a.create(LIMITS)
                await doomed.exec(code="pass")
                running = asyncio.create_task(doomed.exec(code="import time; time.sleep(30)", timeout=30))
                await asyncio.sleep(0.3)
                await a.close()
                with contextlib.suppress(SandboxError):
                    await running
                results = [await other.exec(code=f"print({i})", timeout=3) for i in range(5)]
                yield [(r.stdout_text, r.reason) for r in results]

    async def collect():
        return [rounds async for rounds in run()]

    t0 = time.monotonic()
    rounds = asyncio.run(collect())
    assert rounds == [[(f"{i}\n", "ok") for i in range(5)]] * 3
    assert time.monotonic() - t0 < 15


def test_one_call_sandboxes_of_a_batch_start_no_interpreter(servers):
    """`run_batch` gives each command a sandbox of its own (`create(warm=False)`): a spawn serves one call for less
    than an interpreter started to fork once, so none starts; the commands' results are those of the cold server."""
    backend, cold, warm = servers

    async def batch(path):
        async with await SandboxClient.connect(path) as client:
            before = (await client.info())["warm"]
            results = await client.run_batch([ExecSpec(code=f"print({i} ** 2)") for i in range(4)], LIMITS)
            return [_observed(r) for r in results], (await client.info())["warm"]["starts"] - before["starts"]

    (c, _), (w, starts) = asyncio.run(batch(cold.socket_path)), asyncio.run(batch(warm.socket_path))
    assert c == w and [r[0] for r in w] == [b"0\n", b"1\n", b"4\n", b"9\n"]
    assert starts == 0


def _interpreters() -> list[str]:
    """The CPython 3.8+ interpreters of this machine (system ones and pyenv's), one per version."""
    found = {}
    for pattern in ("/usr/bin/python3.*", "/usr/local/bin/python3.*", str(Path.home() / ".pyenv/versions/3.*/bin/python3")):
        for path in sorted(glob.glob(pattern)):
            if not os.access(path, os.X_OK) or path.endswith("-config"):
                continue
            probe = subprocess.run([path, "-c", "import sys; print(sys.version_info >= (3, 8), sys.version[:4])"],
                                   capture_output=True, text=True, timeout=30)
            ok, _, version = probe.stdout.strip().partition(" ")
            if probe.returncode == 0 and ok == "True":
                found.setdefault(version, path)
    return sorted(found.values())


class _NoNamespaces:
    strong = False


@pytest.mark.parametrize("python", _interpreters() or [pytest.param(None, marks=pytest.mark.skip(reason="no CPython 3.8+"))])
def test_the_interpreter_matches_a_fresh_one_on_every_python_here(python, tmp_path):
    """The warm interpreter's code (warm.py ZYGOTE) against `python -c` of the same interpreter, outside any sandbox
    (no server, no backend: the interpreter run directly), on the snippet table: what the child rebuilds
    (std streams, sys.modules, linecache's -c source from 3.13 on, finalisation) differs across versions."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    skip = {"infinite_loop_timeout", "cpu_burner", "huge_output", "process_tree"}  # the server's kills: above

    async def run():
        children = Children()
        warm = await WarmInterpreter.start(lambda argv: ([python, *argv[1:]], str(tmp_path), env), _NoNamespaces,
                                           children, None)
        differing = {}
        try:
            for name, (args, _) in CASES.items():
                if name in skip:
                    continue
                argv = [python, *(args.get("command") or ["python3", "-c", args["code"]])[1:]]
                stdin = args.get("stdin", b"")
                cold = subprocess.run(argv, input=stdin or None, stdin=None if stdin else subprocess.DEVNULL,
                                      capture_output=True, cwd=tmp_path, env=env, timeout=60)
                warm.busy = True
                call = await warm.call(argv, stdin, strong=False)
                out, err = await asyncio.gather(call.stdout.read(), call.stderr.read())
                rc = await call.wait()
                call.close()
                warm.busy = False
                if (cold.stdout, cold.stderr, cold.returncode) != (out, err, rc):
                    differing[name] = ((cold.stdout, cold.stderr, cold.returncode), (out, err, rc))
        finally:
            await warm.retire()
        return differing

    assert asyncio.run(run()) == {}


SABOTAGE = '''
CTL.send(b"ready")
while True:  # every call in this one process, in one namespace: what forking each call prevents
    msg, ancdata, _, _ = CTL.recvmsg(16, FDS_SPACE)
    fds = received_fds(ancdata)
    argv = b"".join(iter(lambda: os.read(fds[0], 65536), b"")).split(b"\\0")
    saved = os.dup(1)
    os.dup2(fds[-2], 1)
    exec(argv[2].decode(), FRESH_MAIN)
    sys.stdout.flush()
    os.dup2(saved, 1)
    for fd in (*fds, saved):
        os.close(fd)
    CTL.send(b"exit 0 0")
'''


def test_a_server_stopped_as_its_client_leaves_removes_everything(servers):
    """A client leaves (the server closes its sandboxes, killing their warm interpreters: that close waits) and the
    server gets SIGTERM at once: its stop must wait for those closes, not remove the cgroups under them (it
    failed so, exit 1, a work directory left mounted), and leave nothing behind."""
    backend, cold, warm = servers
    scratch = warm.state_dir.parent
    for i in range(3):
        server = LocalServer(scratch / f"stop{i}.sock", scratch / f"stop{i}.state", backend=backend)

        async def use():
            async with await SandboxClient.connect(server.socket_path) as client:
                for _ in range(2):
                    sb = await client.create(LIMITS)
                    await sb.exec(code="print(1)")
                    await sb.exec(code="print(2)")

        try:
            asyncio.run(use())
        finally:
            rc = server.stop()
        assert rc == 0, server.log_path.read_text()[-2000:]
        assert str(server.state_dir) not in Path("/proc/self/mounts").read_text()
        assert list((server.state_dir / "work").iterdir()) == []


class _PatchedServer:
    """A server whose warm interpreter's code has `old` replaced by `new` (a sabotage no option offers)."""

    def __init__(self, scratch: Path, name: str, backend: str, old: str, new: str):
        self.socket_path = scratch / f"{name}.sock"
        patch = ("import sys, sandbox_client.warm as w; w.ZYGOTE = w.ZYGOTE.replace(sys.argv[1], sys.argv[2]); "
                 "from sandbox_client.cli import main; raise SystemExit(main(sys.argv[3:]))")
        self.proc = subprocess.Popen([sys.executable, "-c", patch, old, new, "serve", "--socket", str(self.socket_path),
                                      "--state-dir", str(scratch / f"{name}.state"), "--backend", backend],
                                     cwd=CHECKOUT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while server_pid(self.socket_path) != self.proc.pid:
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def test_a_reused_interpreter_is_caught(servers):
    """The state check above, against a server whose interpreter runs every call itself without forking: it must
    see the leaked state (this test fails if the check could not)."""
    backend, cold, warm = servers
    server = _PatchedServer(warm.state_dir.parent, "reused", backend, "try:\n    become_call(serve())",
                            SABOTAGE + "try:\n    pass")
    try:
        results, stats = asyncio.run(_session(server.socket_path, [LEAVE_STATE, READ_STATE]))
    finally:
        server.stop()
    assert stats["calls"] == 2
    assert results[1].stdout_text.startswith("True True True True"), results


def test_an_interpreter_that_cannot_start_leaves_calls_cold(servers):
    """Where the interpreter cannot start (here: it exits at once), each call runs cold, right; after three such
    sandboxes with none started, the server stops trying."""
    backend, cold, warm = servers
    server = _PatchedServer(warm.state_dir.parent, "nostart", backend, "import sys\n", "raise SystemExit(3)\n")

    async def run():
        async with await SandboxClient.connect(server.socket_path) as client:
            outs = []
            for i in range(4):
                async with await client.create(LIMITS) as sb:
                    outs += [(await sb.exec(code=f"print({i})")).stdout_text, (await sb.exec(code="print('b')")).stdout_text]
            return outs, await client.info()

    try:
        outs, info = asyncio.run(run())
    finally:
        server.stop()
    assert outs == ["0\n", "b\n", "1\n", "b\n", "2\n", "b\n", "3\n", "b\n"]
    assert info["warm"] == {"starts": 0, "calls": 0, "retired": 0} and info["warm_interpreter"] is False
