"""Typed contracts between shardkeeper stages (pydantic only; no torch, no prefect)."""

from schemas.checkpoint import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA_VERSION,
    CheckpointManifest,
    DtypePolicy,
    FileEntry,
    Fingerprint,
    HFModelRecord,
    TensorEntry,
    ValidationReport,
)
from schemas.results import (
    ExportResult,
    LineageEvent,
    PublishResult,
    ReshardResult,
    SegmentResult,
    SegmentStatus,
)
from schemas.run import (
    CheckpointPolicy,
    ClusterTopology,
    DataSpec,
    DeepSpeedSpec,
    ModelSpec,
    OptimSpec,
    PrecisionSpec,
    RunSpec,
    ScheduleSpec,
)

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA_VERSION",
    "CheckpointManifest",
    "CheckpointPolicy",
    "ClusterTopology",
    "DataSpec",
    "DeepSpeedSpec",
    "DtypePolicy",
    "ExportResult",
    "FileEntry",
    "Fingerprint",
    "HFModelRecord",
    "LineageEvent",
    "ModelSpec",
    "OptimSpec",
    "PrecisionSpec",
    "PublishResult",
    "ReshardResult",
    "RunSpec",
    "ScheduleSpec",
    "SegmentResult",
    "SegmentStatus",
    "TensorEntry",
    "ValidationReport",
]
