"""Prefect events of a run, for automations and the event feed:

    shardkeeper.segment.completed | .preempted | .failed | .cancelled | .refused   one per segment launch
    shardkeeper.checkpoint.committed                                     one per committed checkpoint

The resource of a segment event is the run (``shardkeeper.run.<absolute run dir>``); its label
``shardkeeper.resumed-by`` says who resumes a preempted segment: ``flow`` when the flow run that launched
it retries by itself, ``automation`` when it handed the run over (retries spent, after progress) -- the resume
automation created by ``python -m infra.deploy`` matches only the latter, so a run never gets two writers. A
flow run that hands over has recorded that in the run's plan and released the plan's lock *before* the event is
sent: the automation's flow run always finds the plan free to take over. A checkpoint event's resource is the
checkpoint folder, with the run as a related resource.

Emitting never fails a stage: an event is a view of what happened, like the artifacts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from schemas import SegmentResult

log = logging.getLogger(__name__)

SEGMENT_EVENT = "shardkeeper.segment.{status}"
CHECKPOINT_COMMITTED = "shardkeeper.checkpoint.committed"
RUN_RESOURCE_PREFIX = "shardkeeper.run."
RUN_DIR_LABEL = "shardkeeper.run-dir"
RESUMED_BY_LABEL = "shardkeeper.resumed-by"


def run_resource(run_dir: str | Path, run_name: str | None = None, **labels: str) -> dict[str, str]:
    path = str(Path(run_dir).resolve())
    return {
        "prefect.resource.id": RUN_RESOURCE_PREFIX + path,
        "prefect.resource.name": run_name or Path(path).name,
        RUN_DIR_LABEL: path,
        **labels,
    }


def run_resource_match(root: str | Path) -> str:
    """The resource-id pattern of every run directly under ``root`` (Prefect matches a trailing ``*``)."""
    return f"{RUN_RESOURCE_PREFIX}{Path(root).resolve()}/*"


def _emit(
    event: str, resource: dict[str, str], payload: dict[str, Any], related: list[dict[str, str]] | None = None
) -> None:
    try:
        from prefect.events import emit_event

        emit_event(event=event, resource=resource, payload=payload, related=related)
    except Exception as e:  # noqa: BLE001 - see the module docstring
        log.warning("could not emit the Prefect event %s: %s", event, e)


def emit_segment(
    run_dir: str,
    run_name: str,
    result: SegmentResult,
    until_step: int,
    world_size: int,
    resumed_by: Literal["flow", "automation", "none"],
) -> None:
    """``shardkeeper.segment.<status>`` for one launch; the payload repeats the run dir for templates
    (``{{ event.payload.run_dir }}`` in an automation's parameters)."""
    run_dir = str(Path(run_dir).resolve())
    payload = {
        "run_dir": run_dir,
        "segment": result.segment,
        "status": result.status,
        "start_step": result.start_step,
        "end_step": result.end_step,
        "until_step": until_step,
        "world_size": world_size,
        "checkpoint": result.checkpoint,
        "exit_code": result.exit_code,
        "seconds": round(result.seconds, 2),
    }
    _emit(
        SEGMENT_EVENT.format(status=result.status),
        run_resource(run_dir, run_name, **{RESUMED_BY_LABEL: resumed_by}),
        payload,
    )


def emit_checkpoint(
    run_dir: str, run_name: str, ckpt_uri: str | None, ckpt_id: str, step: int | None, data: dict[str, Any]
) -> None:
    """``shardkeeper.checkpoint.committed`` for a checkpoint the lineage recorded."""
    path = ckpt_uri[len("file://") :] if ckpt_uri and ckpt_uri.startswith("file://") else (ckpt_uri or ckpt_id)
    resource = {"prefect.resource.id": f"shardkeeper.checkpoint.{path}", "prefect.resource.name": Path(path).name}
    related = [{**run_resource(run_dir, run_name), "prefect.resource.role": "run"}]
    _emit(
        CHECKPOINT_COMMITTED,
        resource,
        {
            "run_dir": str(Path(run_dir).resolve()),
            "step": step,
            "uri": ckpt_uri,
            **{k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))},
        },
        related,
    )
