"""A local Prefect server on SQLite: start it, wait until it is healthy, stop it cleanly.

    python -m infra.server start            # detached; PREFECT_HOME=.prefect/, http://127.0.0.1:4200
    python -m infra.server status
    python -m infra.server stop             # stops the server and a serving process (infra.serve) it knows of
    python -m infra.server run              # in the foreground until Ctrl-C

Options: ``--port`` (or SHARDKEEPER_PREFECT_PORT), ``--host``, ``--home`` (PREFECT_HOME, default
``.prefect/`` in the repository, git-ignored). A fresh PREFECT_HOME takes ~25 s to become healthy
(the SQLite schema is migrated), later starts ~6 s. Tests and ``infra.demo`` use ``PrefectServer``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from schemas.errors import ServerError  # noqa: F401  (raised here; infra.demo imports it from this module)

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_HOME = REPO / ".prefect"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200
SERVER_PID = "server.pid"
SERVE_PID = "serve.pid"
# The serving process shuts down cleanly on SIGINT (Prefect's SIGTERM handler leaves a coroutine
# unawaited); SIGTERM follows for a process that ignores SIGINT (started with `&` by a script).
SERVE_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """Environment for the server and its clients: own PREFECT_HOME, no analytics (no network here)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def is_healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _signal(pid: int, sig: int) -> None:
    """Signal the process group led by ``pid``, or the process alone when it leads none."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        os.kill(pid, sig)


def stop_process_group(
    pid: int, *, grace_s: float = 20.0, what: str = "process", signals: tuple[int, ...] = (signal.SIGTERM,)
) -> bool:
    """Send each of ``signals`` in turn to the process group led by ``pid``, waiting up to ``grace_s``
    after each for it to end; SIGKILL it if it is still there. False if it was already gone."""
    for i, sig in enumerate(signals):
        try:
            _signal(pid, sig)
        except ProcessLookupError:
            return i > 0
        if _wait_gone(pid, grace_s):
            return True
        log.info("%s %d still running %.0f s after %s", what, pid, grace_s, signal.Signals(sig).name)
    log.warning("%s %d did not stop; killing it", what, pid)
    try:
        _signal(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(pid)
    return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        try:
            _signal(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class PrefectServer:
    """``prefect server start`` in its own process group, with its own PREFECT_HOME and log file."""

    def __init__(self, home: str | Path = DEFAULT_HOME, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        self.home = Path(home).resolve()
        self.host = host
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    @property
    def log_path(self) -> Path:
        return self.home / "server.log"

    def env(self) -> dict[str, str]:
        """Environment for processes that talk to this server (serve, CLI, flows)."""
        return prefect_env(self.home, self.api_url)

    def start(self, timeout_s: float = 120.0) -> PrefectServer:
        if port_in_use(self.host, self.port):
            if is_healthy(self.api_url):
                raise ServerError(
                    f"a server already answers on {self.url}; stop it (python -m infra.server stop) "
                    "or pass --port for another one"
                )
            raise ServerError(
                f"port {self.port} on {self.host} is in use; pass --port (or set SHARDKEEPER_PREFECT_PORT)"
            )
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--analytics-off",
        ]
        with open(self.log_path, "ab") as logf:
            # The UI asks the API at PREFECT_UI_API_URL, which otherwise assumes port 4200.
            env = {**prefect_env(self.home), "PREFECT_UI_API_URL": self.api_url, "PREFECT_UI_URL": self.url}
            self.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.home,
            )
        (self.home / SERVER_PID).write_text(f"{self.proc.pid} {self.port}\n")
        log.info("starting the Prefect server on %s (PREFECT_HOME=%s, log %s)", self.url, self.home, self.log_path)
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-5:]
                raise ServerError(
                    f"the Prefect server exited with code {self.proc.returncode} at start; "
                    f"see {self.log_path}: {' | '.join(tail)}"
                )
            if is_healthy(self.api_url):
                log.info("Prefect server healthy after %.1f s: %s", time.monotonic() - t0, self.url)
                return
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"the Prefect server was not healthy within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc.pid, what="Prefect server")
            self.proc.wait()
            self.proc = None
        (self.home / SERVER_PID).unlink(missing_ok=True)

    def __enter__(self) -> PrefectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_pid(path: Path) -> tuple[int, int | None] | None:
    try:
        parts = path.read_text().split()
        return int(parts[0]), (int(parts[1]) if len(parts) > 1 else None)
    except (FileNotFoundError, ValueError, IndexError):
        return None


def stop_recorded(home: Path) -> list[str]:
    """Stop the serving process and the server whose pid files are in ``home``; say what was stopped."""
    done = []
    plan = ((SERVE_PID, "serving process", SERVE_STOP_SIGNALS), (SERVER_PID, "Prefect server", (signal.SIGTERM,)))
    for name, what, signals in plan:
        rec = _read_pid(home / name)
        if rec and stop_process_group(rec[0], what=what, signals=signals, grace_s=10.0):
            done.append(f"{what} (pid {rec[0]})")
        (home / name).unlink(missing_ok=True)
    return done


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infra.server", description="A local Prefect server on SQLite.")
    p.add_argument("action", choices=("start", "stop", "status", "run"))
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=int(os.environ.get("SHARDKEEPER_PREFECT_PORT", DEFAULT_PORT)))
    p.add_argument(
        "--home", type=Path, default=DEFAULT_HOME, help="PREFECT_HOME (default: .prefect/ in the repository)"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for health")
    return p.parse_args(argv)


def setup_logging() -> None:
    """INFO for shardkeeper's scripts; the HTTP clients' per-request lines stay quiet."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = _parse(argv)
    server = PrefectServer(args.home, host=args.host, port=args.port)
    try:
        if args.action == "stop":
            done = stop_recorded(server.home)
            print("stopped " + ", ".join(done) if done else "nothing to stop")
        elif args.action == "status":
            ok = is_healthy(server.api_url)
            print(f"{server.url}: {'healthy' if ok else 'not answering'}")
            return 0 if ok else 1
        elif args.action == "start":
            server.start(args.timeout)
            server.proc = None  # detached: leave it running; `stop` finds it by its pid file
            print(
                f"Prefect UI: {server.url}   "
                f"(export PREFECT_API_URL={server.api_url}; stop: python -m infra.server stop)"
            )
        else:
            stop_signals = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
            with server:
                print(f"Prefect UI: {server.url}; Ctrl-C stops it")
                signal.sigwait(stop_signals)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
