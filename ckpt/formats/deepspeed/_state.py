"""shardkeeper's own files beside DeepSpeed's in a ``step-XXXXXXXX/`` directory of the deepspeed format: the names
and the state record (``shardkeeper_state.json``). Stdlib only, like the format's layout check that reads them
(``ckpt.formats.deepspeed.format``): ``status`` and ``validate`` of a DeepSpeed run import no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.errors import CheckpointError

STATE_FILE = "shardkeeper_state.json"  # counters, schedule position, ZeRO stage, layout ("zero" | "universal")
UNIVERSAL_DIR = "universal"  # DeepSpeed universal layout, committed with its own manifest.json


def read_state(ckpt_dir: Path) -> dict[str, Any]:
    """The shardkeeper_state.json of a deepspeed-format checkpoint."""
    path = ckpt_dir / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; not a shardkeeper deepspeed checkpoint, pick another step") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path}: unreadable JSON ({e}); the checkpoint is corrupted, pick another step"
        ) from None
    if not isinstance(state, dict) or state.get("layout") not in ("zero", "universal"):
        raise CheckpointError(f"{path}: no valid 'layout' field; the checkpoint is corrupted, pick another step")
    return state
