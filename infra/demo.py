"""The whole pipeline, end to end, on this machine: ``make demo`` (or ``python -m infra.demo``).

1. starts a Prefect server on SQLite (PREFECT_HOME=.prefect/, http://127.0.0.1:4200),
2. serves the flows as deployments (infra.serve),
3. runs ``train-and-export/demo``: the tiny model on 2 ranks to step 10, then 3 ranks to step 20,
   deep validation, bfloat16 export to runs/demo/exports/step-00000020, publish to
   file://runs/demo/published, lineage artifacts,
4. prints where to look in the UI, stops the serving process and the server; exit 1 if the flow
   run did not complete. ``--keep`` leaves both running (Ctrl-C stops them) to browse the UI.

Takes about 1-2 minutes on 2 CPU cores. The runs stay in the server's database: reopen the UI later
with ``python -m infra.server start``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from infra.serve import DEMO_DEPLOYMENT, DEMO_RUN_DIR, REPO
from infra.server import (
    DEFAULT_HOME,
    DEFAULT_HOST,
    DEFAULT_PORT,
    SERVE_STOP_SIGNALS,
    PrefectServer,
    ServerError,
    setup_logging,
    stop_process_group,
)
from schemas.seam import EXIT_CANCELLED

log = logging.getLogger(__name__)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infra.demo", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=int(os.environ.get("SHARDKEEPER_PREFECT_PORT", DEFAULT_PORT)))
    p.add_argument("--home", type=Path, default=DEFAULT_HOME, help="PREFECT_HOME (default .prefect/)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the flow run")
    p.add_argument("--keep", action="store_true", help="leave the server and the serving process running")
    return p.parse_args(argv)


def start_serving(server: PrefectServer) -> subprocess.Popen[bytes]:
    """``python -m infra.serve`` in its own process group; its output (the flow logs) goes to ours."""
    cmd = [sys.executable, "-m", "infra.serve", "--port", str(server.port), "--home", str(server.home)]
    return subprocess.Popen(cmd, env=server.env(), cwd=REPO, start_new_session=True, stdin=subprocess.DEVNULL)


async def wait_for_deployment(name: str, serving: subprocess.Popen[bytes], timeout_s: float = 180.0) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    t0 = time.monotonic()
    async with get_client() as client:
        while time.monotonic() - t0 < timeout_s:
            if serving.poll() is not None:
                raise ServerError(f"the serving process exited with code {serving.returncode}; see its output above")
            try:
                await client.read_deployment_by_name(name)
                return
            except ObjectNotFound:
                await asyncio.sleep(1.0)
    raise ServerError(f"deployment {name} did not appear within {timeout_s:.0f} s; see the serving process output")


async def run_demo(server: PrefectServer, timeout_s: float) -> tuple[Any, list[str]]:
    """Run the demo deployment to a final state; return the flow run and its artifact keys."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    flow_run = await run_deployment(DEMO_DEPLOYMENT, timeout=timeout_s, poll_interval=2)
    async with get_client() as client:
        arts = await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    return flow_run, sorted({a.key for a in arts if a.key})


def report(server: PrefectServer, flow_run: Any, keys: list[str]) -> bool:
    state = flow_run.state
    ok = bool(state and state.is_completed())
    print("\n" + "=" * 78)
    print(
        f"flow run {flow_run.name}: {state.name if state else 'unknown'}"
        + ("" if ok or not state or not state.message else f" ({state.message})")
    )
    print(f"  flow run:   {server.url}/runs/flow-run/{flow_run.id}   (tab 'Artifacts' for the lineage)")
    for key in keys:
        print(f"  artifact:   {server.url}/artifacts/key/{key}")
    print(f"  run dir:    {DEMO_RUN_DIR}   (shardkeeper lineage {DEMO_RUN_DIR.relative_to(REPO)})")
    print(f"  export:     {DEMO_RUN_DIR / 'exports' / 'step-00000020'}")
    print(f"  published:  {(DEMO_RUN_DIR / 'published').as_uri()}")
    port = "" if server.port == DEFAULT_PORT else f" --port {server.port}"
    print(f"  reopen UI:  python -m infra.server start{port}   (then {server.url}; stop: python -m infra.server stop)")
    print("=" * 78)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    setup_logging()
    server = PrefectServer(args.home, host=DEFAULT_HOST, port=args.port)
    os.environ.update(server.env())  # before prefect is imported: settings come from the environment
    if DEMO_RUN_DIR.exists():
        log.info("removing the previous demo run %s", DEMO_RUN_DIR)
        shutil.rmtree(DEMO_RUN_DIR)
    serving: subprocess.Popen[bytes] | None = None
    try:
        server.start()
        serving = start_serving(server)
        asyncio.run(wait_for_deployment(DEMO_DEPLOYMENT, serving))
        log.info("running %s (tiny model, 2 ranks then 3 ranks); flow logs follow", DEMO_DEPLOYMENT)
        flow_run, keys = asyncio.run(run_demo(server, args.timeout))
        ok = report(server, flow_run, keys)
        if args.keep:
            print(f"server and serving process left running: browse {server.url}; Ctrl-C stops them")
            _wait_for_ctrl_c()
        return 0 if ok else 1
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_CANCELLED  # 128 + SIGINT
    finally:
        if serving is not None:
            stop_process_group(serving.pid, what="serving process", signals=SERVE_STOP_SIGNALS)
            serving.wait()
        server.stop()


def _wait_for_ctrl_c() -> None:
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)


if __name__ == "__main__":
    sys.exit(main())
