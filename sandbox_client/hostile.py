"""The hostile-code suite (issue #16's evidence): code that attacks the host through a real client and a real
server, each case judged from the host's side. tests/integration/test_sandbox_hostile.py asserts every case;
bench/sandbox.py reports how many are contained.

A `HostWorld` is what the attacks aim at: canary files planted in the host's home and in the project checkout,
a TCP listener on the host's 127.0.0.1, and the server's process. Every case closes its sandboxes and checks
that no process of the sandbox's host uid survives, that its work directory is gone, and that the server
still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from sandbox_client.client import Sandbox, SandboxClient
from sandbox_client.launch import LocalServer
from sandbox_client.protocol import MAX_FRAME, decode
from sandbox_client.records import AdmissionRefused, ExecResult, Limits, SandboxError
from sandbox_client.processes import uid_processes

CHECKOUT = Path(__file__).resolve().parents[1]
LIMITS = Limits(memory_mib=128, cpu_s=1.0, max_processes=32, timeout_s=5.0, output_bytes=1 << 20)
"""Small limits, so that every case ends within seconds."""
FRAME_FLOOD_CONNECTIONS = 4
"""How many connections `frame_flood` opens: their announced frames pass the server's budget."""


@dataclass(frozen=True)
class Outcome:
    case: str
    contained: bool
    reason: str
    """The reason of the attack's exec ("" where the attack is no single exec)."""
    detail: str


class HostWorld:
    """The host side: a server (started here), canaries, a loopback listener and a scratch directory for the
    cases that start servers of their own. A context manager; leaves nothing behind."""

    def __init__(self, scratch: Path, *, backend: str = "bwrap", max_sandboxes: int = 16):
        self.scratch, self.backend, self.max_sandboxes = scratch, backend, max_sandboxes
        self.token = secrets.token_hex(8)
        self.secret = secrets.token_hex(16)
        """What the canaries hold (their names hold `token`, which error messages may echo)."""
        self.canaries = [Path.home() / f".sandbox-canary-{self.token}", CHECKOUT / f".sandbox-canary-{self.token}"]
        self.listener = socket.socket()
        self.server: LocalServer | None = None

    def __enter__(self) -> "HostWorld":
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.scratch.chmod(0o711)  # sandbox uids traverse it to their work directories
        for path in self.canaries:
            path.write_text(f"canary {self.secret}\n")
        try:
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen()
            self.listener.setblocking(False)
            self.server = self.start_server("main", max_sandboxes=self.max_sandboxes)
        except BaseException:  # a server that does not start leaves no canary behind either
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
        self.listener.close()
        for path in self.canaries:
            path.unlink(missing_ok=True)

    def start_server(self, name: str, *, max_sandboxes: int) -> LocalServer:
        return LocalServer(self.scratch / f"{name}.sock", self.scratch / f"{name}.state", backend=self.backend,
                           max_sandboxes=max_sandboxes)

    @property
    def socket_path(self) -> Path:
        return self.server.socket_path

    def listener_connections(self) -> int:
        """Connections the loopback listener has received (and accepted now)."""
        n = 0
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1


async def _leftovers(client: SandboxClient, sb: Sandbox, server: LocalServer) -> list[str]:
    """Close `sb`, then what survived it: processes of its uid, its work directory, a dead server."""
    await sb.close()
    problems = []
    if pids := uid_processes(sb.host_uid):
        problems.append(f"processes {pids} of uid {sb.host_uid} survive close")
    if Path(sb.host_work_dir).exists():
        problems.append(f"{sb.host_work_dir} survives close")
    if server.proc.poll() is not None:
        problems.append("the server died")
    else:
        await client.info()
    return problems


def _verdict(name: str, r: ExecResult | None, problems: list[str], ok_detail: str) -> Outcome:
    reason = r.reason if r is not None else ""
    return Outcome(name, not problems, reason, "; ".join(problems) if problems else ok_detail)


async def _one_exec(world: HostWorld, name: str, judge: Callable[[ExecResult, Sandbox], list[str]],
                    limits: Limits = LIMITS, **exec_args) -> Outcome:
    """Run one attack in a fresh sandbox of the world's server, judge it, then check what survives close."""
    async with await SandboxClient.connect(world.socket_path) as client:
        sb = await client.create(limits)
        r = await sb.exec(**exec_args)
        problems = judge(r, sb)
        problems += await _leftovers(client, sb, world.server)
    return _verdict(name, r, problems, f"{r.reason}, exit {r.exit_code}, signal {r.signal}, {r.duration_s:.2f} s")


def _want(r: ExecResult, reason: str, max_s: float) -> list[str]:
    out = [] if r.reason == reason else [f"reason {r.reason}, not {reason} (stderr: {r.stderr_text[-200:]!r})"]
    return out + ([f"took {r.duration_s:.1f} s, more than {max_s} s"] if r.duration_s > max_s else [])


# ---- the cases -----------------------------------------------------------------------------------------------

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
MEMORY_HOG = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
ONE_GB = "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)\n"


async def fork_bomb(world: HostWorld) -> Outcome:
    return await _one_exec(world, "fork_bomb", lambda r, sb: _want(r, "processes", 4.0), code=FORK_BOMB, timeout=3)


async def memory_hog(world: HostWorld) -> Outcome:
    return await _one_exec(world, "memory_hog", lambda r, sb: _want(r, "memory", 4.0), code=MEMORY_HOG, timeout=3)


async def cpu_spin(world: HostWorld) -> Outcome:
    return await _one_exec(world, "cpu_spin", lambda r, sb: _want(r, "cpu", 3.0), code="while True: pass", timeout=4)


def _settled(uid: int | None, within_s: float = 2.0) -> list[int]:
    """The uid's live processes once SIGKILLed ones had `within_s` to exit (the kernel ends a PID namespace's
    processes after its init dies, not at once; on a loaded machine that takes a moment)."""
    end = time.monotonic() + within_s
    while (left := uid_processes(uid)) and time.monotonic() < end:
        time.sleep(0.01)
    return left


async def sleep_past_timeout(world: HostWorld) -> Outcome:
    def judge(r, sb):
        left = _settled(sb.host_uid)  # the tree dies with the exec, not only at close
        return _want(r, "timeout", 2.5) + ([f"processes {left} survive the timeout"] if left else [])

    return await _one_exec(world, "sleep_past_timeout", judge, command="sleep 60 & sleep 60", timeout=1)


async def host_loopback(world: HostWorld) -> Outcome:
    port = world.listener.getsockname()[1]
    code = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"s.connect(('127.0.0.1', {port}))\nprint('connected')\n")

    def judge(r, sb):
        out = ["connected to the host's listener"] if "connected" in r.stdout_text else []
        out += ["the host's listener got a connection"] if world.listener_connections() else []
        return out + ([] if r.exit_code not in (0, None) else [f"exit {r.exit_code}"])

    return await _one_exec(world, "host_loopback", judge, code=code)


def _read_canary(index: int, name: str):
    async def case(world: HostWorld) -> Outcome:
        path = world.canaries[index]
        code = f"print(open({str(path)!r}).read())"
        return await _one_exec(world, name, lambda r, sb: [f"read {path}"] if world.secret in r.stdout_text + r.stderr_text
                               else [], code=code)

    case.__name__ = name
    return case


read_home_canary = _read_canary(0, "read_home_canary")
read_checkout_canary = _read_canary(1, "read_checkout_canary")


async def write_outside_workdir(world: HostWorld) -> Outcome:
    name = f"sandbox-escape-{world.token}"
    targets = [Path.home() / name, CHECKOUT / name, Path("/tmp") / name, Path("/usr") / name, Path("/etc") / name,
               Path("/") / name, world.scratch / name]
    code = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'w').write('x')\n"
            "    except OSError as e:\n        print(p, e.strerror)\n")

    def judge(r, sb):
        written = [p for p in targets if p.exists()]
        for p in written:
            p.unlink()
        return [f"wrote {', '.join(map(str, written))}"] if written else []

    return await _one_exec(world, "write_outside_workdir", judge, command=["python3", "-c", code, *map(str, targets)])


async def planted_symlink(world: HostWorld) -> Outcome:
    """Symlinks the sandbox plants in its work directory, aimed at host files, then followed by the server's
    `read_file` and `write_file`: they must resolve in the sandbox's view, where those files do not exist."""
    target = CHECKOUT / f"sandbox-symlink-{world.token}"
    async with await SandboxClient.connect(world.socket_path) as client:
        sb = await client.create(LIMITS)
        r = await sb.exec(["ln", "-s", str(world.canaries[0]), "leak"])
        await sb.exec(["ln", "-s", str(target), "plant"])
        problems = [] if r.ok else [f"ln failed: {r.stderr_text!r}"]
        with contextlib.suppress(SandboxError):
            if world.secret.encode() in await sb.read_file("leak"):
                problems.append(f"read_file followed a symlink to {world.canaries[0]}")
        with contextlib.suppress(SandboxError):
            await sb.write_file("plant", "x")
        if target.exists():
            target.unlink()
            problems.append(f"write_file followed a symlink to {target}")
        problems += await _leftovers(client, sb, world.server)
    return _verdict("planted_symlink", r, problems, "read_file and write_file stayed in the sandbox's view")


async def unprivileged_uid(world: HostWorld) -> Outcome:
    code = ("import os\nopen('owner-probe', 'w').write('x')\n"
            "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]\n"
            "print(os.getuid(), caps)\n")

    def judge(r, sb):
        probe = Path(sb.host_work_dir) / "owner-probe"
        if not probe.exists():
            return [f"no probe file ({r.stderr_text[-200:]!r})"]
        owner = probe.stat().st_uid
        uid, caps = r.stdout_text.split()
        out = [f"a file it made is owned by host uid {owner}"] if owner == 0 or owner != sb.host_uid else []
        out += [f"uid {uid} inside"] if uid == "0" else []
        return out + ([f"effective capabilities {caps}"] if int(caps, 16) else [])

    return await _one_exec(world, "unprivileged_uid", judge, code=code)


async def kill_parent(world: HostWorld) -> Outcome:
    code = ("import os\nfor target in (os.getppid(), 1, -1):\n    try:\n        os.kill(target, 9)\n"
            "    except OSError as e:\n        print(target, e.strerror)\nprint('still here')\n")
    async with await SandboxClient.connect(world.socket_path) as client:
        sb = await client.create(LIMITS)
        r = await sb.exec(code=code)
        again = await sb.exec(code="print('next exec runs')")
        problems = [] if again.stdout_text == "next exec runs\n" else [f"the sandbox broke: {again}"]
        problems += await _leftovers(client, sb, world.server)
    return _verdict("kill_parent", r, problems, f"the server and the sandbox live on ({r.reason}, exit {r.exit_code})")


async def huge_output(world: HostWorld) -> Outcome:
    def judge(r, sb):
        out = _want(r, "output_truncated", 5.0)
        if not r.stdout_truncated or len(r.stdout) != sb.limits.output_bytes:
            out.append(f"{len(r.stdout)} bytes kept, truncated={r.stdout_truncated}")
        return out

    return await _one_exec(world, "huge_output", judge, code=ONE_GB, timeout=10)


async def leftover_background(world: HostWorld) -> Outcome:
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(300)\n    os._exit(0)\nprint('daemon started')\n")
    return await _one_exec(world, "leftover_background", lambda r, sb: [] if r.ok else [f"{r}"], code=code)


async def admission_refused(world: HostWorld) -> Outcome:
    server = world.start_server("admission", max_sandboxes=2)
    try:
        async with await SandboxClient.connect(server.socket_path) as client:
            held = [await client.create(LIMITS), await client.create(LIMITS)]
            t0 = time.monotonic()
            try:
                await client.create(LIMITS)
                problems = ["a third sandbox was admitted past the limit of 2"]
            except AdmissionRefused as e:
                waited = time.monotonic() - t0
                problems = [] if e.retryable and waited < 1.0 else [f"refused after {waited:.2f} s, retryable={e.retryable}"]
            for sb in held[:1]:
                problems += await _leftovers(client, sb, server)
            after = await client.create(LIMITS)  # the freed slot admits again
            for sb in (held[1], after):
                problems += await _leftovers(client, sb, server)
    finally:
        server.stop()
    return _verdict("admission_refused", None, problems, "the third create was refused at once, retryable")


async def reap_after_kill9(world: HostWorld) -> Outcome:
    server = world.start_server("reap", max_sandboxes=4)
    client = await SandboxClient.connect(server.socket_path)
    sb = await client.create(LIMITS)
    running = asyncio.create_task(sb.exec("sleep 300", timeout=300))
    for _ in range(200):
        if uid_processes(sb.host_uid):
            break
        await asyncio.sleep(0.02)
    record = json.loads((server.state_dir / "live" / f"{sb.id}.json").read_text())
    server.kill()
    with contextlib.suppress(SandboxError):
        await running
    await client.close()
    left = [p for p in [record["work"], *record["cgroups"]] if Path(p).exists()]
    again = world.start_server("reap", max_sandboxes=4)
    try:
        problems = [f"{p} survives the restart" for p in [record["work"], *record["cgroups"]] if Path(p).exists()]
        if pids := uid_processes(sb.host_uid):
            problems.append(f"processes {pids} of uid {sb.host_uid} survive the restart")
        if list((again.state_dir / "live").iterdir()):
            problems.append("records of dead sandboxes remain")
    finally:
        again.stop()
    return _verdict("reap_after_kill9", None, problems, f"left after kill -9: {len(left)} paths; reaped at restart")


DISK_FILL = ("import errno, os, sys\nwhat = sys.argv[1]\ndone = 0\ntry:\n    if what == 'bytes':\n"
             "        block = b'x' * (1 << 20)\n        for i in range(64):\n"
             "            with open(f'fill{i}', 'wb') as f:\n                f.write(block)\n            done += 1\n"
             "    else:\n        os.mkdir('many')\n        for i in range(100_000):\n"
             "            open(f'many/{i}', 'wb').close()\n            done += 1\n"
             "except OSError as e:\n    print(errno.errorcode[e.errno], done)\nelse:\n    print('no error', done)\n")
"""Writes 64 files of 1 MiB, or 100,000 empty files, into the work directory; prints the errno that stopped
it and how many it made."""


async def fill_disk(world: HostWorld) -> Outcome:
    """A work directory is capped in bytes and in files (Limits.disk_mib, disk_inodes): writing past either
    fails inside the sandbox with ENOSPC, and the host's disk never holds more than the cap."""
    limits = Limits(**{**LIMITS.model_dump(), "disk_mib": 16, "disk_inodes": 1000})
    problems, results = [], []
    async with await SandboxClient.connect(world.socket_path) as client:
        sb = await client.create(limits)
        for what, most in (("bytes", 16), ("inodes", 1000)):
            r = await sb.exec(["python3", "-c", DISK_FILL, what], timeout=5)
            results.append(r)
            got = r.stdout_text.split()
            if len(got) != 2 or got[0] != "ENOSPC" or not int(got[1]) <= most:
                problems.append(f"{what}: {r.stdout_text.strip()!r} (wanted ENOSPC after at most {most}; "
                                f"stderr {r.stderr_text[-200:]!r})")
            await sb.exec("rm -rf fill* many")
        await sb.write_file("after.txt", "still writable")  # the caps hold the files, not the sandbox
        problems += await _leftovers(client, sb, world.server)
    return _verdict("fill_disk", results[0], problems, "bytes and files past the caps: ENOSPC inside the sandbox")


async def foreign_sandbox(world: HostWorld) -> Outcome:
    """A sandbox id works only on the connection that created it: another connection naming it gets the same
    "no such sandbox" as for an id that never existed, and the sandbox is untouched."""
    problems = []
    async with await SandboxClient.connect(world.socket_path) as owner, \
            await SandboxClient.connect(world.socket_path) as other:
        sb = await owner.create(LIMITS)
        await sb.write_file("mine.txt", "owner's")
        for op, args in [("exec", {"argv": ["rm", "mine.txt"]}), ("write_file", {"path": "mine.txt", "data": b"x"}),
                         ("read_file", {"path": "mine.txt"}), ("snapshot", {}), ("restore", {"data": b""}),
                         ("close", {})]:
            for sid in (sb.id, "sb-000000000000"):
                try:
                    await other.call(op, wait_s=10, sandbox_id=sid, **args)
                    problems.append(f"{op} on {sid} from another connection succeeded")
                except SandboxError as e:
                    if str(e) != f"no such sandbox {sid!r}":
                        problems.append(f"{op} on {sid} from another connection: {e}")
        if await sb.read_file("mine.txt") != b"owner's":
            problems.append("another connection changed the sandbox's files")
        problems += await _leftovers(owner, sb, world.server)
    return _verdict("foreign_sandbox", None, problems, "another connection's requests got 'no such sandbox'")


def _raw_frame_start(path: Path, size: int, sent: int) -> socket.socket:
    """A connection that announced a frame of `size` bytes and sent only its first `sent`."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    s.sendall(struct.pack(">I", size) + b"\0" * sent)
    return s


def _answer_or_eof(s: socket.socket, within_s: float) -> tuple[dict | None, bool]:
    """The frame the server sends on `s` within `within_s` (None if none), and whether it then closed `s`."""
    s.settimeout(within_s)
    data = b""
    try:
        while chunk := s.recv(1 << 16):
            data += chunk
    except (TimeoutError, socket.timeout):
        return (decode(data[4:]) if len(data) > 4 else None), False
    except ConnectionError:
        pass
    return (decode(data[4:]) if len(data) > 4 else None), True


async def frame_flood(world: HostWorld) -> Outcome:
    """Frames are bounded in total, not only one by one: connections that each announce a frame near
    MAX_FRAME and send a little of it hold at most the server's budget; the one past it gets an error frame
    and is closed, and every other client is served."""
    problems = []
    held = [_raw_frame_start(world.socket_path, MAX_FRAME - 1024, 1 << 16) for _ in range(FRAME_FLOOD_CONNECTIONS)]
    try:
        await asyncio.sleep(0.2)
        answers = [await asyncio.to_thread(_answer_or_eof, s, 0.5) for s in held]
        refused = [a for a, closed in answers if closed and a is not None and not a.get("ok", True)]
        if not refused:
            problems.append(f"{len(held)} connections each announcing {MAX_FRAME >> 20} MiB: none was refused")
        elif "budget" not in refused[0]["error"]["message"]:
            problems.append(f"refused with {refused[0]}")
        async with await SandboxClient.connect(world.socket_path) as client:
            await client.info()
            async with await client.create(LIMITS) as sb:
                if (await sb.exec("echo served")).stdout != b"served\n":
                    problems.append("a client during the flood was not served")
    finally:
        for s in held:
            s.close()
    return _verdict("frame_flood", None, problems, "the connection past the frame budget was refused")


DAMAGED_RECORDS = {"sb-00000000000a.json": b'{"id": "sb-00000000000a", "uid": 20', "sb-00000000000b.json": b"[1, 2]",
                   "sb-00000000000c.json": b"\xff\xfe"}
"""Records in `live/` as a crash or a full disk leaves them: truncated, not a record, not text."""


async def damaged_state(world: HostWorld) -> Outcome:
    """A server starts on a state directory whose records are damaged (each skipped with a log line) and whose
    etc/ holds symlinks to host files (replaced, the host files untouched)."""
    state = world.scratch / "damaged.state"
    victim = world.scratch / f"damaged-victim-{world.token}"
    victim.write_text("host file\n")
    (state / "live").mkdir(parents=True, exist_ok=True)
    (state / "etc").mkdir(exist_ok=True)
    for name, data in DAMAGED_RECORDS.items():
        (state / "live" / name).write_bytes(data)
    for name in ("passwd", "group"):
        (state / "etc" / name).unlink(missing_ok=True)
        (state / "etc" / name).symlink_to(victim)
    problems = []
    try:
        server = world.start_server("damaged", max_sandboxes=2)
    except RuntimeError as e:
        return _verdict("damaged_state", None, [str(e)], "")
    try:
        async with await SandboxClient.connect(server.socket_path) as client:
            async with await client.create(LIMITS) as sb:
                if (await sb.exec("echo up")).stdout != b"up\n":
                    problems.append("the server's sandboxes do not run")
        log = server.log_path.read_text(errors="replace")
        problems += [f"no log line about {name}" for name in DAMAGED_RECORDS if name not in log]
    finally:
        server.stop()
        shutil.rmtree(state, ignore_errors=True)
    if victim.read_text() != "host file\n":
        problems.append(f"{victim} was written through a symlink in etc/")
    victim.unlink()
    return _verdict("damaged_state", None, problems, "damaged records skipped, symlinks in etc/ not followed")


CASES: dict[str, Callable[[HostWorld], Awaitable[Outcome]]] = {
    c.__name__: c for c in (
        fork_bomb, memory_hog, cpu_spin, sleep_past_timeout, host_loopback, read_home_canary, read_checkout_canary,
        write_outside_workdir, planted_symlink, unprivileged_uid, kill_parent, huge_output, leftover_background, admission_refused,
        reap_after_kill9, fill_disk, foreign_sandbox, frame_flood, damaged_state)}
"""Every hostile case by name; each returns an `Outcome` judged on the host."""


def run_case(name: str, world: HostWorld) -> Outcome:
    """One case, start to end, in its own event loop (a case that raises is not contained)."""
    try:
        return asyncio.run(CASES[name](world))
    except (SandboxError, OSError, ValueError, RuntimeError) as e:
        return Outcome(name, False, "", f"{type(e).__name__}: {e}")
