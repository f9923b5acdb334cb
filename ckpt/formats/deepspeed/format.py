"""The DeepSpeed ZeRO format: its entry in the format registry (``ckpt.registry``).

What a DeepSpeed checkpoint holds: ``shardkeeper_state.json`` (counters, layout), DeepSpeed's flat per-rank
files (``zero_pp_rank_N_mp_rank_00_optim_states.pt``, ``mp_rank_00_model_states.pt``, ``rng_rank_N.pt``), or
in the universal layout ``zero/<parameter>/<key>.pt``; a committed ``universal/`` sub-checkpoint may sit
beside them with its own manifest. Another world size needs the universal layout (``ensure_universal``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckpt.commit.state import MOMENTS
from ckpt.formats.deepspeed._state import STATE_FILE, UNIVERSAL_DIR, read_state
from ckpt.registry import register
from ckpt.validate.checks import RANK_RE, check_ranks
from schemas import CheckpointManifest, Fingerprint

OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
UNIVERSAL_RE = re.compile(r"^zero/(?:optimizer_state\.pt|[^/]+/(?:fp32|" + "|".join(MOMENTS) + r"|step)\.pt)$")


def check_layout(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    listed = {e.path for e in manifest.files}
    if ckpt_dir.name == UNIVERSAL_DIR:  # written by the converter from the parent's files
        return (
            []
            if "zero/optimizer_state.pt" in listed
            else [
                f"{ckpt_dir}: no zero/optimizer_state.pt listed; the universal checkpoint is incomplete, convert again"
            ]
        )
    state_path = ckpt_dir / STATE_FILE
    if STATE_FILE not in listed:
        return [f"{state_path}: not listed in the manifest; not a shardkeeper deepspeed checkpoint"]
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return [f"{state_path}: unreadable ({e}); the checkpoint is corrupted, pick another step"]
    if not isinstance(state, dict):
        return [f"{state_path}: not a JSON object; the checkpoint is corrupted, pick another step"]
    for key in ("step", "tokens", "samples"):
        if state.get(key) != getattr(manifest, key):
            return [
                f"{state_path}: {key} {state.get(key)!r}, the manifest says {getattr(manifest, key)}; "
                "the checkpoint is inconsistent, pick another step"
            ]
    if state.get("world_size") != manifest.topology.world_size:
        return [
            f"{state_path}: world_size {state.get('world_size')!r}, the manifest's topology says "
            f"{manifest.topology.world_size}; the checkpoint is inconsistent, pick another step"
        ]
    ranks = {p: int(m.group(1)) for p in listed if "/" not in p and (m := RANK_RE.search(p))}
    required: set[int] = set()
    if state.get("layout") == "zero":
        optim = {int(m.group(1)) for p in listed if (m := OPTIM_RE.match(p))}
        required = set(range(manifest.topology.world_size))
        if optim != required:
            missing = sorted(required - optim)
            what = f"missing the optimizer file of rank {missing[0]}" if missing else "optimizer files of other ranks"
            return [
                f"{ckpt_dir}: expected {len(required)} ZeRO optimizer files, the manifest lists {len(optim)} "
                f"({what}); the checkpoint is inconsistent, pick another step"
            ]
    return check_ranks(ckpt_dir, manifest, ranks, required)


def check_pickles(ckpt_dir: Path, manifest: CheckpointManifest) -> None:
    """Parse every torch.save file of a deepspeed checkpoint with the allow-list (rng files and the files
    only DeepSpeed's own loaders read included); CheckpointError naming the first refused file."""
    from ckpt.formats.pickle.torchzip import check_file

    for entry in manifest.files:
        if entry.path.endswith(".pt"):
            check_file(ckpt_dir / entry.path)


class DeepSpeedFormat:
    name = "deepspeed"
    nested: frozenset[str] = frozenset({UNIVERSAL_DIR})

    def path_error(self, rel: str) -> str | None:
        if "/" not in rel or UNIVERSAL_RE.match(rel):
            return None
        return "DeepSpeed checkpoints hold flat files and zero/<parameter>/<key>.pt only"

    def check_layout(self, ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
        return check_layout(ckpt_dir, manifest)

    def recompute_fingerprint(self, ckpt_dir: Path, manifest: CheckpointManifest) -> Fingerprint:
        """ZeRO shards or a universal folder, one parameter at a time, every .pt parsed with the allow-list."""
        from ckpt.formats.deepspeed.convert import recompute_fingerprint

        check_pickles(ckpt_dir, manifest)
        return recompute_fingerprint(ckpt_dir, manifest)

    def convert_from(self, src_dir: Path, target: Path, *, zero_stage: int | None = None) -> Path:
        from ckpt.formats.deepspeed.convert import from_dcp

        return from_dcp(src_dir, target, zero_stage=zero_stage)

    def reshard(self, ckpt_dir: Path, manifest: CheckpointManifest, world_size: int) -> tuple[Path, str, float]:
        from ckpt.formats.deepspeed.convert import ensure_universal

        if manifest.topology.world_size == world_size and read_state(ckpt_dir)["layout"] == "zero":
            return ckpt_dir, "none", 0.0
        res = ensure_universal(ckpt_dir, to_world_size=world_size)
        return res.path, "deepspeed-universal", res.seconds


FORMAT = register(DeepSpeedFormat())
