"""The run's plan as the flows keep it (schemas.plan.RunPlan in ``RUN_DIR/plan.json``, ckpt.plan):

    keeper = PlanKeeper.start(request, current_driver("flow"))      # train-and-export: a new plan, its lock held
    keeper = PlanKeeper.take_over(run_dir, current_driver("resume")) # a resumer: the plan as it stands, lock held
    keeper.segment_started(i); keeper.segment_done(i, end_step); keeper.exported(...); keeper.complete()

Every change rewrites the file atomically while the keeper holds the plan lock; ``release`` (or handing the
plan over) lets the next resumer take it. ``current_driver`` says which flow run drives the plan: the
train-and-export flow run, or a resume flow run created by the preemption automation, by the interval schedule
or by someone else -- from the flow run's own record on the Prefect server.

Plain functions and a plain class (no Prefect tasks): a plan change is a small file write, not a stage.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from ckpt.commit.lineage import now_iso
from ckpt.plan import PLAN_LOCK_NAME, PlanLock, read_plan, write_plan
from schemas.plan import PLAN_NAME, Driver, DriverKind, PlanStatus, RunPlan, StageDone
from schemas.requests import TrainExportRequest

log = logging.getLogger(__name__)

HANDED_OVER = "HandedOver"  # the state name of a train-and-export flow run that left its plan to the automation


def plan_root(run_dir: str) -> Path:
    """Where a run's plan lives: the run directory, or for a run on an object store its local cache."""
    if "://" in str(run_dir):
        from ckpt.store.objstore import RemoteRun

        return RemoteRun(str(run_dir)).local.root
    return Path(run_dir).resolve()


def peek_plan(run_dir: str) -> tuple[RunPlan | None, str]:
    """The run's plan as it stands and who drives it now ("" when nobody holds its lock); reads beside the
    writer. Raises ckpt.plan.PlanError for a plan.json that is not a valid plan."""
    root = plan_root(run_dir)
    plan = read_plan(root)
    if plan is None:
        return None, ""
    lock = PlanLock(root)
    return plan, (lock.holder() or "another process") if lock.is_locked() else ""


def current_driver(default: DriverKind) -> Driver:
    """Who the current flow run is: a resume flow run created by an automation (``automation``) or by its
    deployment's schedule (``schedule``), else ``default``; with its id and name. Outside a flow run: ``default``."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = getattr(ctx, "flow_run", None) if ctx is not None else None
    if run is None:
        return Driver(kind=default)
    kind: DriverKind = default
    source: str | None = None
    created_by = getattr(run, "created_by", None)
    if default != "flow" and created_by is not None and str(getattr(created_by, "type", "")).upper() == "AUTOMATION":
        kind, source = "automation", getattr(created_by, "display_value", None)
    elif default != "flow" and getattr(run, "auto_scheduled", False):
        kind, source = "schedule", _deployment_name()
    return Driver(kind=kind, flow_run_id=str(run.id), flow_run_name=run.name, source=source)


def _deployment_name() -> str | None:
    try:
        from prefect.runtime import deployment, flow_run

        name = deployment.name
        return f"{flow_run.flow_name}/{name}" if name else None
    except Exception:  # noqa: BLE001 - a name for people; the kind says the rest
        return None


class PlanKeeper:
    """The plan of one run, held (plan lock) by the flow run that drives it, written at every change."""

    def __init__(self, run_dir: str, plan: RunPlan, lock: PlanLock, driver: Driver, *, created: bool = False):
        self.run_dir = run_dir
        self.root = plan_root(run_dir)
        self.plan = plan
        self.lock = lock
        self.driver = driver
        self.created = created  # the plan made the run directory (start): discard_if_untouched may remove it

    @classmethod
    def start(cls, request: TrainExportRequest, driver: Driver) -> PlanKeeper:
        """Take the plan lock of ``request.run_dir`` and write the request's plan, nothing done yet (it replaces
        an earlier plan of the run). Raises RunLockedError (one line) while another flow run drives a plan."""
        root = plan_root(request.run_dir)
        created = not root.exists()
        lock = PlanLock(root).acquire(driver.line())
        try:
            now = now_iso()
            plan = RunPlan.from_request(request, plan_id=uuid.uuid4().hex, started_by=driver, now=now)
            write_plan(root, plan)
        except BaseException:
            lock.release()
            raise
        return cls(request.run_dir, plan, lock, driver, created=created)

    @classmethod
    def take_over(cls, run_dir: str, driver: Driver) -> PlanKeeper | None:
        """Take the plan lock of ``run_dir`` and read its plan as it stands (None, lock released, when it has none).
        Raises RunLockedError while another flow run drives it, PlanError for an unreadable plan.json."""
        root = plan_root(run_dir)
        lock = PlanLock(root).acquire(driver.line())
        try:
            plan = read_plan(root)
        except BaseException:
            lock.release()
            raise
        if plan is None:
            lock.release()
            return None
        return cls(run_dir, plan, lock, driver)

    # ------------------------------------------------------------------------------------------- changes
    def _save(self, **update: Any) -> RunPlan:
        if not self.lock.held:  # handed over or released: the plan is someone else's to write now
            return self.plan
        self.plan = self.plan.model_copy(update={**update, "updated": now_iso()})
        write_plan(self.root, self.plan)
        return self.plan

    def driving(self) -> RunPlan:
        """This flow run drives the plan now (a resumer that took it over)."""
        return self._save(status="running", driver=self.driver, note=f"driven by {self.driver.line()}")

    def segment_done(self, index: int, end_step: int, *, ran: bool = True) -> RunPlan:
        """Segment ``index`` reached its until_step at ``end_step`` (``ran``: this flow run launched it)."""
        progress = list(self.plan.progress)
        progress[index] = progress[index].model_copy(
            update={"status": "completed", "end_step": end_step, "by": self._by(index, ran)}
        )
        return self._save(progress=progress)

    def segment_stopped(self, index: int, status: PlanStatus, note: str) -> RunPlan:
        """Segment ``index``, launched by this flow run, ended the plan here (``status``); the lock is released."""
        progress = list(self.plan.progress)
        progress[index] = progress[index].model_copy(update={"by": self._by(index, True)})
        self._save(progress=progress)
        return self.stop(status, note)

    def _by(self, index: int, ran: bool) -> list[Driver]:
        by = self.plan.progress[index].by
        return [*by, self.driver] if ran and (not by or by[-1] != self.driver) else list(by)

    def exported(self, step: int, out_dir: str) -> RunPlan:
        return self._save(exported=StageDone(step=step, out=out_dir, by=self.driver, time=now_iso()))

    def published(self, step: int, where: str) -> RunPlan:
        return self._save(published=StageDone(step=step, out=where, by=self.driver, time=now_iso()))

    def complete(self) -> RunPlan:
        return self._save(status="completed", note=f"finished by {self.driver.line()}")

    def stop(self, status: PlanStatus, note: str) -> RunPlan:
        """The plan stops here (handed over, stopped, failed, cancelled) and its lock is released."""
        try:
            return self._save(status=status, note=" ".join(note.split()))
        finally:
            self.release()

    def release(self) -> None:
        self.lock.release()

    def discard_if_untouched(self) -> bool:
        """Remove the plan and the run directory it created when nothing else was written there (the first
        segment was refused before it wrote anything): a refused request leaves no trace. True if removed."""
        self.release()
        if not self.created or not self.root.is_dir():
            return False
        ours = {PLAN_NAME, PLAN_LOCK_NAME}
        if not set(os.listdir(self.root)) <= ours:
            return False
        for name in ours:
            (self.root / name).unlink(missing_ok=True)
        try:
            self.root.rmdir()
        except OSError:
            return False
        return True


def complete_handed_over_run(plan: RunPlan) -> str | None:
    """The train-and-export flow run that started ``plan`` (completed now by someone else) set to Completed, with a
    message that names who finished it -- only while it is in the HandedOver state it ended in (nothing else it
    may have become since is overwritten). Returns the message, or None when nothing was changed. Best effort:
    a resume is never failed by it."""
    run_id = plan.started_by.flow_run_id
    if plan.status != "completed" or run_id is None or plan.driver == plan.started_by:
        return None
    try:
        from prefect.client.orchestration import get_client
        from prefect.states import Completed

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(uuid.UUID(run_id)).state
            if state is None or state.name != HANDED_OVER or not state.is_final():
                return None
            message = f"its plan was finished by {plan.note.removeprefix('finished by ')}: {plan.where()}"
            client.set_flow_run_state(uuid.UUID(run_id), Completed(message=message), force=True)
            return message
    except Exception as e:  # noqa: BLE001 - a view of the run's record; the plan file stays the truth
        log.warning("could not mark flow run %s completed: %s", run_id, e)
        return None
