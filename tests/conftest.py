"""Session fixtures shared by the test modules.

``prefect_server``: one real ``prefect server start`` (SQLite, temporary PREFECT_HOME, free port,
UI included) per test process (``make test`` runs two pytest-xdist workers: one server each);
this process's Prefect settings point at it, so flows called in tests run against it and the
browser test can open its UI. It replaces ``prefect_test_harness`` (whose server has no UI) and
costs ~10-25 s once per process.

``tiny_run``: the tiny model trained 5 steps on 2 ranks through ``shardkeeper.stages`` (one torchrun
launch per test process, ~10 s), shared read-only: copy it before changing anything.

``ds_run``: the same for DeepSpeed ZeRO-2. Both are guarded: a test that changes anything inside one (a
lineage line appended by an export or ``validate --deep``, a file planted) errors, naming the path, so no
test depends on another's side effects on a shared fixture.

The segments the tests launch keep the default ``checkpoint.restarts`` (torchrun under shardkeeper's agent, with
the node's fork server), but the fork server warms up with nothing to import (``SHARDKEEPER_FORK_PRELOAD=""``):
its warm-up imports torch, DCP and transformers (~1.2 s of CPU a launch, measured side by side), which only a
restart in place uses, and the suite is CPU-bound on two cores. The tests of restarts in place
(tests/reliability/test_failure_attribution.py) and the fork server's own (test_units) set the preload they need.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.s3_server")  # a plugin of the s3 test modules, imported by them first

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("SHARDKEEPER_FORK_PRELOAD", "")  # see above: inherited by every launch the tests start
TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
TINY_RUN_STEPS = 5


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real local Prefect server with UI; yields infra.server.PrefectServer (``.url``, ``.api_url``)."""
    from infra.server import PrefectServer
    from tests.harness import free_port

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    home = tmp_path_factory.mktemp("prefect-home")
    server = PrefectServer(home, port=free_port()).start()
    try:
        import prefect.context
        import prefect.settings as ps

        updates = {ps.PREFECT_API_URL: server.api_url, ps.PREFECT_HOME: str(home)}
        with (
            ps.temporary_settings(updates=updates),
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
        ):
            yield server
            _drain_prefect_workers()
    finally:
        server.stop()


def _drain_prefect_workers() -> None:
    """Flush buffered logs and events before the server goes (as prefect_test_harness does)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:
            pass  # never started
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run directory: tiny model, 2 ranks, steps 0 -> 5, one completed segment. Read-only."""
    from shardkeeper.config import load_run_spec
    from shardkeeper.stages import plan_topology, train_segment

    run = tmp_path_factory.mktemp("tiny") / "tiny-run"
    spec = load_run_spec(TINY_CONFIG)
    result = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), TINY_RUN_STEPS)
    assert result.status == "completed", result.failure
    return run


SHARED_RUNS = ("tiny_run", "ds_run")


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and modification time (ns)."""
    state = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        state[str(path.relative_to(root))] = (st.st_size if path.is_file() else -1, st.st_mtime_ns)
    return state


@pytest.fixture(autouse=True)
def _shared_runs_stay_untouched(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test that modified a shared session run (it must copy the run first)."""
    used = [name for name in SHARED_RUNS if name in request.fixturenames]
    if not used:
        yield
        return
    runs = {name: request.getfixturevalue(name) for name in used}
    before = {name: tree_state(run) for name, run in runs.items()}
    yield
    for name, run in runs.items():
        after = tree_state(run)
        changed = sorted(set(before[name]) ^ set(after)) + sorted(
            k for k in set(before[name]) & set(after) if before[name][k] != after[k]
        )
        if changed:
            pytest.fail(
                f"this test modified the shared fixture {name} ({', '.join(changed[:5])}): "
                "copy it first (it is shared read-only by the whole session)",
                pytrace=False,
            )


@pytest.fixture(autouse=True)
def _stop_signals_restored() -> Iterator[None]:
    """The CLI called in-process (``shardkeeper.cli.main(["train", ...])``) installs the early stop handlers, which
    remember SIGTERM/SIGINT instead of acting on them: restored after each test, so a stop signal (Ctrl-C) reaches
    the test session again and no test sees a signal another one left pending."""
    import signal

    import launch.early as early

    before = {s: signal.getsignal(s) for s in early.STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
    early.pending_stop.clear()


@pytest.fixture
def lineage_run(tmp_path: Path) -> Path:
    """A run directory with hand-written lineage and metrics (no torch): 2 ranks to step 6, then a
    failed segment at 2 ranks that repeated steps 6-7, then 3 ranks from step 6 to 10, exported."""
    from ckpt.commit import lineage
    from ckpt.commit.fsutil import append_jsonl

    run = tmp_path / "lineage-run"
    ck = lineage.checkpoint_event_id
    for step in (3, 6):
        lineage.record(
            run,
            "checkpoint",
            ck(step),
            parent=ck(step - 3) if step > 3 else None,
            step=step,
            reason="interval" if step == 3 else "end",
            world_size=2,
            segment=0,
            uri=f"file://{run}/checkpoints/{step}",
        )
    lineage.record(run, "segment", "segment:0", step=6, status="completed", world_size=2)
    lineage.record(run, "resume", "resume:segment-1", parent=ck(6), step=6, from_world_size=2, to_world_size=2)
    lineage.record(run, "segment", "segment:1", parent=ck(6), step=6, status="failed", world_size=2)
    lineage.record(
        run,
        "reshard",
        "reshard:step-00000006:3",
        parent=ck(6),
        step=6,
        method="dcp-load-time",
        from_world_size=2,
        to_world_size=3,
    )
    lineage.record(run, "resume", "resume:segment-2", parent=ck(6), step=6, from_world_size=2, to_world_size=3)
    for step, parent in ((9, 6), (10, 9)):
        lineage.record(
            run,
            "checkpoint",
            ck(step),
            parent=ck(parent),
            step=step,
            reason="interval" if step == 9 else "end",
            world_size=3,
            segment=2,
        )
    lineage.record(run, "export", "export:step-00000010:bfloat16", parent=ck(10), step=10, dtype="bfloat16")
    rows = [(s, 0, 2) for s in range(1, 7)] + [(7, 1, 2), (8, 1, 2)] + [(s, 2, 3) for s in range(7, 11)]
    for step, segment, world in rows:
        append_jsonl(
            run / "metrics.jsonl",
            {
                "step": step,
                "loss": 5.0 - 0.1 * step + (0.5 if segment == 1 else 0.0),
                "segment": segment,
                "world_size": world,
            },
        )
    return run


@pytest.fixture(scope="session")
def ds_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real DeepSpeed ZeRO-2 run dir: 2 ranks, steps 0 -> 2, one checkpoint at step 2 (one launch; CPU ranks
    skip DeepSpeed's JIT-built shm op, see trainer.deepspeed.shm). Read-only."""
    from importlib.util import find_spec

    if find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    from ckpt.commit.layout import RunDir
    from shardkeeper.config import load_run_spec
    from shardkeeper.stages import prepare_run_dir
    from tests.harness import spawn
    from trainer.segment import run_segment

    mp = pytest.MonkeyPatch()
    mp.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    )
    mp.setenv("DS_ACCELERATOR", "cpu")
    try:
        run = tmp_path_factory.mktemp("ds") / "run"
        spec = load_run_spec(
            ROOT / "configs" / "tiny.yaml",
            ["backend=deepspeed", "deepspeed.zero_stage=2", "checkpoint.interval=2", "checkpoint.keep_last=10"],
        )
        prepare_run_dir(RunDir.at(run), spec)
        assert spawn(run_segment, 2, str(run), 2, 0, timeout=900) == [0, 0]
    finally:
        mp.undo()
    return run


# Modules whose tests run in this process or in in-process rank groups: no torchrun launch, no Prefect, Slurm or S3
# server, no browser. ``make test-fast`` runs them (their own launching tests are marked slow where they stand);
# every other module's tests are marked slow here. A new module is slow until it is listed.
FAST_MODULES = frozenset(
    {
        "test_bad_input",
        "test_bench_tables",
        "test_corruption",
        "test_crafted_sources",
        "test_direct_io",
        "test_docs",
        "test_export",
        "test_fuzz",
        "test_gpu",
        "test_hostile_pickles",
        "test_identity",
        "test_kubernetes",
        "test_layering",
        "test_onepass",
        "test_performance",
        "test_publish",
        "test_retention_sweep",
        "test_scale_checks",
        "test_strict",
        "test_units",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of every module not in FAST_MODULES slow (what ``make test-fast`` leaves out)."""
    for item in items:
        if item.path.stem not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)
