"""CPU ranks skip DeepSpeed's shared-memory all-reduce op.

The first time a CPU rank initializes DeepSpeed's communication backend (``deepspeed.initialize`` /
``deepspeed.init_distributed``), DeepSpeed JIT-compiles ``deepspeed_shm_comm`` with g++ (about 2 minutes on 2 cores,
on every fresh machine). Only its ``inference_all_reduce`` uses that op; training collectives go through
torch.distributed (gloo on CPU), as ours do. So CPU ranks make ``deepspeed.comm.torch.build_shm_op`` return None
(DeepSpeed's own "not available" answer) -- for the built-in trainer and for a user's script alike, whether DeepSpeed
is imported before or after the process group exists. ``SHARDKEEPER_DS_SHM_OP=1`` keeps DeepSpeed's default.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_MODULE = "deepspeed.comm.torch"


def _no_shm_op() -> None:
    return None


def _patch(mod: ModuleType) -> None:
    if hasattr(mod, "build_shm_op"):
        mod.build_shm_op = _no_shm_op  # type: ignore[attr-defined]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``deepspeed.comm.torch`` is found by the other finders, wraps its loader so the
    module is patched right after it executes (before DeepSpeed can call build_shm_op)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                loader = spec.loader
                original = loader.exec_module

                def exec_module(module: ModuleType) -> None:
                    original(module)  # noqa: B023
                    _patch(module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def skip_shm_op() -> None:
    """Make DeepSpeed skip building its CPU shared-memory op in this process (idempotent)."""
    if os.environ.get("SHARDKEEPER_DS_SHM_OP") == "1":
        return
    mod = sys.modules.get(_MODULE)
    if mod is not None:
        _patch(mod)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
