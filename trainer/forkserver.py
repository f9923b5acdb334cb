"""The node's fork server: ranks restarted in place start from a process that has imported torch already.

A rank started as a new process spends seconds importing torch, torch.distributed and transformers before it does
anything for its segment (``bench/startup_profile.py`` measures it). When a segment restarts its ranks in place
(``checkpoint.restarts``, ``trainer.agent``), the node's agent starts each new rank through this module instead:

- **The server** (``python -u -m trainer.forkserver serve SOCKET RUN_DIR``), started by the agent with the
  segment, in a session of its own (a stop signal to the agent's process group never reaches it), tied to the agent
  by the parent-death signal. It imports nothing heavy until it is asked to: by the ranks' first optimizer step
  (``warm``, sent by local rank 0, so the import never competes with the segment's own start-up), or by the first
  request. It then imports torch, torch.distributed's checkpoint, FSDP2 and tensor packages, transformers' model code
  and the rank's own modules, and waits.
- **A restarted rank** is, as torchrun sees it, ``python -u -m trainer.forkserver rank WORKER_ARGS``: a stdlib-only
  client that starts in milliseconds, sends the server its argument list, environment, working directory and file
  descriptors 0, 1 and 2, and waits. The server forks; the child becomes the rank (below) and runs ``python -u -m
  trainer.segment ...`` as that command would, as ``__main__``. The client forwards every signal it gets (torchrun's
  SIGTERM, the launcher's stack request) to the rank through the server, and when the rank ends it ends the same way
  (the same exit code, or killed by the same signal), so torchrun and the launcher see the rank's end as its own. The
  client gone (SIGKILLed by torchrun) is the rank SIGKILLed by the server; the server gone is every rank it forked
  gone (their parent-death signal).

The child is made a fresh process before the rank's code runs: a session of its own (as torchrun starts ranks), the
client's descriptors as 0, 1, 2 and none of the server's, every signal disposition as a new interpreter has it
(SIGINT raising KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored, the rest default) and none blocked, the client's
environment (so RANK, MASTER_PORT, TORCHELASTIC_RESTART_COUNT ... are the new rank's) and working directory, and
Python's own RNG reseeded (``random`` does so after every fork; numpy's global RNG, when imported, here). It then runs
``trainer.segment``'s start-up like any rank: its parent-death signal (the server's death), its watchdog, the run's
shared ``.lock.ranks`` and faulthandler's stack dump on request (``trainer.lifetime.guard_rank``, which knows the
rank's torchrun is its parent's parent), its start time from /proc (the fork) for the segment's phases. A process it
leaves behind is adopted by ``launch.contain``, torchrun's subreaper, as any rank's is.

Forking is safe only in a process with one thread and no CUDA context: the server checks both right before every
fork (torch's import starts no thread and no CUDA context; OpenBLAS starts threads unless ``OMP_NUM_THREADS=1``,
which the launchers set), and when either fails -- or the server is gone, or the import failed -- the client answers
by ``exec``-ing the rank's command itself: a fresh rank, slower, never a wrong one. ``SHARDKEEPER_FORK_SERVER=off``
in the launcher's environment turns the fork server off.

Stdlib only at import: the client must start fast.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVE, RANK, WARM = "serve", "rank", "warm"
# Set by the node's agent (trainer.agent): the UNIX socket of the node's fork server ("off": none); and, in a rank the
# server forked, the server's pid (trainer.lifetime then finds the rank's torchrun one process further up).
FORK_SERVER_ENV = "SHARDKEEPER_FORK_SERVER"
FORKED_ENV = "SHARDKEEPER_FORKED_BY"
RANK_NOTES_ENV = "SHARDKEEPER_RANK_NOTES"  # = schemas.seam.RANK_NOTES_ENV (this module stays stdlib only)
# What a rank imports before it does anything for its segment (the built-in trainer and a script alike): the
# server imports it once, and every rank it forks starts with it imported.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "schemas",
    "ckpt.commit.layout",
    "trainer.dist",
    "trainer.api.segment",
    "trainer.checkpointer.core",
    "trainer.checkpointer.dcp_backend",
    "trainer.builtin.loop",
    "trainer.api.script",
)
PRELOAD_ENV = "SHARDKEEPER_FORK_PRELOAD"  # comma-separated modules instead of PRELOAD (tests)
# The signals a client passes on to its rank: torchrun's stop (SIGTERM, then SIGKILL, which ends the client and so
# the rank), a preemption's SIGUSR1, the launcher's request for the rank's stacks (SIGURG, schemas.seam.STACKS_SIGNAL).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGURG,
)
_HEADER = struct.Struct("!I")
MAX_MESSAGE = 16 << 20


# --------------------------------------------------------------------------------------------- messages
def send_message(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    """One length-prefixed JSON object; ``fds`` go with one more byte after it (SCM_RIGHTS)."""
    data = json.dumps(obj).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)
    if fds:
        socket.send_fds(sock, [b"F"], fds)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """The next object, or None at the end of the stream (the peer is gone) or on a malformed one."""
    head = _read_exact(sock, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_MESSAGE:
        return None
    data = _read_exact(sock, size)
    if data is None:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 1, count)
    return list(fds)


def worker_module(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` of a worker command ``[-u, ..., -m, MODULE, ARGS...]`` (interpreter flags before ``-m``
    that change nothing here: -u, -B, -s, -E are the server's own), or None for any other form."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            if all(a in ("-u", "-B") for a in argv[:i]):
                return argv[i + 1], list(argv[i + 2 :])
            return None
    return None


# --------------------------------------------------------------------------------------------- the server
@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket
    status: int | None = None


@dataclass
class Server:
    """One node's fork server (see the module doc). ``run_dir``: the segment's run directory (its backend tells which
    trainer modules the ranks import)."""

    path: str
    run_dir: str
    preload: tuple[str, ...] = PRELOAD
    warm: bool = False
    problem: str | None = None  # why it cannot fork (the import failed): every request is answered 'fresh'
    children: dict[int, _Child] = field(default_factory=dict)  # by pidfd

    def __post_init__(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.conns: set[socket.socket] = set()

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    conn.settimeout(30)
                    self.conns.add(conn)
                    self.sel.register(conn, selectors.EVENT_READ, "conn")
                elif key.data == "conn":
                    self._on_message(key.fileobj)  # type: ignore[arg-type]
                else:
                    self._on_exit(key.fileobj)  # type: ignore[arg-type]

    def _close(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.conns.discard(conn)
        conn.close()

    def _child_of(self, conn: socket.socket) -> _Child | None:
        return next((c for c in self.children.values() if c.conn is conn), None)

    def _on_message(self, conn: socket.socket) -> None:
        try:
            msg = recv_message(conn)
        except OSError:
            msg = None
        if msg is None:  # the client is gone: its rank must not outlive it (torchrun SIGKILLed the client)
            child = self._child_of(conn)
            if child is not None and child.status is None:
                _kill(child.pid, signal.SIGKILL)
            self._close(conn)
            return
        op = msg.get("op")
        if op == WARM:
            self._close(conn)
            self.load()
        elif op == "fork":
            self._fork(conn, msg)
        elif op == "signal":
            child = self._child_of(conn)
            if child is not None and child.status is None and isinstance(msg.get("signal"), int):
                _kill(child.pid, msg["signal"])

    def load(self) -> None:
        """Import what every rank imports (once); a failure is remembered and every rank then starts fresh."""
        if self.warm:
            return
        self.warm = True
        modules = list(self.preload) + _backend_modules(self.run_dir)
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: BLE001 - any import error: no fork, ranks start fresh
                self.problem = f"importing {name} failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                break

    def unsafe(self) -> str | None:
        """Why a fork now would not give a fresh process (None: it would)."""
        if self.problem:
            return self.problem
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:
            threads = 1
        if threads != 1:
            return f"the fork server runs {threads} threads (set OMP_NUM_THREADS=1 for the segment)"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return "the fork server has a CUDA context"
        return None

    def _fork(self, conn: socket.socket, req: dict[str, Any]) -> None:
        try:
            fds = recv_fds(conn, 3)
        except OSError:
            fds = []
        self.load()
        target = worker_module(req.get("argv") or [])
        problem = (
            self.unsafe()
            or (None if len(fds) == 3 else "the rank's descriptors did not arrive")
            or (None if target else f"not a python -m command: {req.get('argv')}")
        )
        if problem is not None:
            for fd in fds:
                os.close(fd)
            _reply(conn, {"fresh": problem})
            self._close(conn)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._become_rank(req, fds, target)  # never returns
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = _Child(pid, pidfd, conn)
        self.sel.register(pidfd, selectors.EVENT_READ, "child")
        _reply(conn, {"pid": pid})

    def _on_exit(self, pidfd: int) -> None:
        child = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(child.pid, 0)
        child.status = os.waitstatus_to_exitcode(status)
        if child.conn in self.conns:
            _reply(child.conn, {"exit": child.status})
            self._close(child.conn)

    def _become_rank(self, req: dict[str, Any], fds: list[int], target: tuple[str, list[str]] | None) -> None:
        """In the forked child: a fresh process, then the rank's module as ``__main__``. Never returns."""
        code = 1
        try:
            os.setsid()
            for target_fd, fd in enumerate(fds):
                os.dup2(fd, target_fd, inheritable=True)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            self.sel.close()
            self.listener.close()
            for conn in self.conns:
                conn.close()
            for pidfd in self.children:
                os.close(pidfd)
            fresh_signals()
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
            os.environ[FORKED_ENV] = str(os.getppid())
            os.chdir(req.get("cwd") or "/")
            if sys.path and sys.path[0] != os.getcwd():
                sys.path[0] = os.getcwd()  # python -m puts the working directory first
            reseed()
            module, args = target  # type: ignore[misc]
            import runpy

            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as an uncaught exception ends python -m
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def _reply(conn: socket.socket, obj: dict[str, Any]) -> None:
    try:
        send_message(conn, obj)
    except OSError:
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _backend_modules(run_dir: str) -> list[str]:
    """A DeepSpeed run's ranks import its trainer too; read from the run's run.yaml. DeepSpeed itself is left to each
    rank: its import looks for accelerators, which must not happen before a fork."""
    try:
        text = (Path(run_dir) / "run.yaml").read_text(encoding="utf-8")
    except OSError:
        return []
    return ["trainer.deepspeed.backend"] if "backend: deepspeed" in text else []


# Signals the server's parent left ignored (nohup's SIGHUP, a shell's SIGQUIT): a fresh rank inherits them ignored
# too, so a forked one gets them ignored again (recorded by ``serve`` before it changes any).
_INHERITED_IGNORED: frozenset[int] = frozenset()


def _ignored_now() -> frozenset[int]:
    return frozenset(
        sig
        for sig in signal.valid_signals()
        if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) == signal.SIG_IGN
    )


def fresh_signals() -> None:
    """Every signal disposition as a new interpreter started by the server's parent has it, none blocked, no wakeup
    descriptor."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in _INHERITED_IGNORED else signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    if signal.SIGINT not in _INHERITED_IGNORED:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.set_wakeup_fd(-1)


def reseed() -> None:
    """What a new process draws from the OS at start-up: ``random`` reseeds itself after a fork; numpy's global RNG
    (seeded from the OS when numpy is imported) is reseeded here. torch's default generator needs nothing: it starts
    from a fixed seed in every process, and the server never draws from it."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def serve(path: str, run_dir: str) -> int:
    preload = os.environ.get(PRELOAD_ENV)
    modules = tuple(m for m in preload.split(",") if m) if preload is not None else PRELOAD
    global _INHERITED_IGNORED
    _INHERITED_IGNORED = _ignored_now()
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):  # a terminal's or a stray stop signal: not ours
        signal.signal(sig, signal.SIG_IGN)
    Server(path, run_dir, modules).serve_forever()
    return 0


# --------------------------------------------------------------------------------------------- the client
def client(argv: list[str]) -> None:
    """A restarted rank as torchrun sees it: the fork server's child runs ``python ARGV``; this process forwards
    signals to it and ends as it ends. Without a server that can fork, it becomes ``python ARGV`` itself (exec)."""
    pending: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(signum: int, _frame: object) -> None:
        pending.append(signum)
        try:
            os.write(wake_w, b"s")
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, on_signal)
    path = os.environ.get(FORK_SERVER_ENV, "")
    reply: dict[str, Any] | None = None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        send_message(conn, {"op": "fork", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
        reply = recv_message(conn)
    except OSError as e:
        reply = {"fresh": f"no fork server at {path!r} ({e.strerror or e})"}
    if reply is None or "pid" not in reply:
        _exec_fresh(argv, pending, (reply or {}).get("fresh", "the fork server did not answer"))
    _tell_launcher(int(reply["pid"]))
    _proxy(conn, wake_r, pending)


def _tell_launcher(pid: int) -> None:
    """Which process is the rank this client stands for: ``$SHARDKEEPER_RANK_NOTES/forked-<client pid>``, where the
    launcher's watch looks when the client ends (the kernel's word on a SIGKILL names the rank's pid, not this)."""
    notes = os.environ.get(RANK_NOTES_ENV)
    if notes:
        try:
            Path(notes, f"forked-{os.getpid()}").write_text(str(pid))
        except OSError:
            pass


def _exec_fresh(argv: list[str], pending: list[int], why: str) -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"shardkeeper: the restarted ranks start as new processes: {why}", file=sys.stderr, flush=True)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    if pending:  # a stop that came first ends this process as it would have ended the rank's
        os.kill(os.getpid(), pending[0])
    os.execv(sys.executable, [sys.executable, *argv])


def _proxy(conn: socket.socket, wake_r: int, pending: list[int]) -> None:
    """Forward signals to the rank until the server says how it ended, then end the same way."""
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ, "server")
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    sent = 0
    while True:
        while sent < len(pending):
            try:
                send_message(conn, {"op": "signal", "signal": pending[sent]})
            except OSError:
                pass
            sent += 1
        for key, _ in sel.select():
            if key.data == "signal":
                os.read(wake_r, 4096)
                continue
            try:
                msg = recv_message(conn)
            except OSError:
                msg = None
            _end_as(msg.get("exit") if msg else None)


def _end_as(status: Any) -> None:
    """Exit with the rank's code, or die of the signal that killed it (the server gone: as its ranks, by SIGKILL)."""
    if not isinstance(status, int):
        status = -int(signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    if status >= 0:
        os._exit(status)
    sig = -status
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # their disposition cannot be changed, nor need be
        try:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):
            pass
    try:
        os.kill(os.getpid(), sig)
    except OSError:
        pass
    os._exit(128 + sig)  # a signal whose default action does not end a process


def warm() -> None:
    """Ask this node's fork server to import now (local rank 0, after the segment's first optimizer step); a no-op
    without one."""
    path = os.environ.get(FORK_SERVER_ENV)
    if not path or path == "off" or os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get(FORKED_ENV):
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(path)
            send_message(s, {"op": WARM})
    except OSError:
        pass


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == RANK:
        client(argv[1:])
    elif len(argv) == 3 and argv[0] == SERVE:
        sys.exit(serve(argv[1], argv[2]))
    else:
        print("usage: python -m trainer.forkserver serve SOCKET RUN_DIR | rank WORKER_ARGS...", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
