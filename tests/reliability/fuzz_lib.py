"""Property-based fuzzing of every reader of a checkpoint someone else wrote (not a test module: the short run is
``tests/reliability/test_fuzz.py``, the long one ``bench/fuzz.py``).

A *program* (drawn by Hypothesis, ``TARGETS[name].strategy``) is a short list of mutations of one seed of the
committed corpus (``tests.reliability.fuzz_corpus``): structured edits through the files' own types (DCP's metadata
dataclasses, DeepSpeed's pickled dicts, JSON) and raw byte flips, truncations and insertions. Each program is applied
to fresh copies of its seed, one per entry point, and every copy goes through the real entry point -- ``shardkeeper
import`` and ``shardkeeper validate --deep`` (the CLI's ``main``), a resume (the trainer's ``Checkpointer.load_latest``
on one in-process rank, into the live FSDP2 model), the launcher's persist of a memory snapshot. The outcome is
judged against reference readers written here with torch's own loader (``dcp_reference``, ``ds_reference``), and
only two are allowed:

* ``correct``: the state that came out (imported tensors, the live model and optimizer after a load, a persisted
  snapshot's bytes) equals the seed's where the mutation did not change what the files say, or else exactly what
  the mutated files say when they still form a well-made checkpoint; ``validate`` says valid only when every byte
  is intact (or, with the manifest's checksums recomputed, when the files still form a checkpoint whose stored
  state the manifest's fingerprint describes);
* ``refused``: a typed ShardkeeperError in one line (the CLI: exit 2 or 4, exactly one ``error:`` line naming the
  input), nothing committed, no run directory left, the input's bytes untouched.

Anything else is ``other`` (a traceback, an internal error, a wrong state, a valid verdict on changed bytes, a
refusal of an input whose bytes are the seed's, a hang past the deadline, memory past the bound).

Every entry point runs in its own process, forked from a warm worker (``Fuzzer``): the deadline kills it, and its
peak resident memory comes from the kernel (``wait4``); an address-space limit stops a runaway allocation first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import pickle
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from tests.reliability import fuzz_corpus as fc

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
RSS_BOUND = 512 * MiB  # resident memory an input may add to the forked worker's (the seeds are < 0.3 MB)
ADDRESS_SPACE_MARGIN = 4 << 30  # address space beyond the worker's: a runaway allocation fails before the machine does
OUTCOMES = ("refused", "correct", "other")

# ----------------------------------------------------------------------------------------------- values
INTS = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    15,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    65,
    127,
    128,
    255,
    256,
    1023,
    1024,
    4096,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    -1,
    -2,
    -(2**31),
    -(2**63),
]
ODD = ["none", "float", "nan", "str", "list", "bool", "dict"]
_ODD_VALUES: dict[str, Any] = {
    "none": None,
    "float": 1.5,
    "nan": float("nan"),
    "str": "1",
    "list": [1],
    "bool": True,
    "dict": {},
}
pick = st.integers(0, 1 << 16)
value = st.one_of(
    st.tuples(st.just("int"), st.sampled_from(INTS)),
    st.tuples(st.just("delta"), st.integers(-3, 3)),
    st.tuples(st.just("odd"), st.sampled_from(ODD)),
)


def resolve(spec: list | tuple, orig: Any) -> Any:
    """A drawn value: an interesting int, the original plus a small delta, or a value of another type."""
    kind, arg = spec
    if kind == "int":
        return arg
    if kind == "delta":
        return orig + arg if type(orig) is int else arg
    return _ODD_VALUES[arg]


def raw_op(prefix: str = "raw") -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just(f"{prefix}_flip"), pick, st.integers(1, 255)),
        st.tuples(st.just(f"{prefix}_trunc"), pick),
        st.tuples(st.just(f"{prefix}_insert"), pick, st.integers(0, 255)),
    )


def apply_raw(data: bytes, ops: list) -> bytes:
    """Byte flips, truncations and insertions at positions taken modulo the length."""
    b = bytearray(data)
    for op in ops:
        kind = op[0].rsplit("_", 1)[1]
        if not b:
            break
        pos = op[-2 if kind != "trunc" else -1] % len(b)
        if kind == "flip":
            b[pos] ^= op[-1]
        elif kind == "trunc":
            del b[pos:]
        else:
            b[pos:pos] = bytes([op[-1]])
    return bytes(b)


def is_raw(op: list | tuple) -> bool:
    return op[0].endswith(("_flip", "_trunc", "_insert"))


def regular_bytes(path: Path) -> bytes | None:
    """The bytes of a regular file (symlinks followed), None for anything else: this harness never waits on a fifo
    an earlier mutation made."""
    try:
        return path.read_bytes() if stat.S_ISREG(path.stat().st_mode) else None
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------- trees
def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): a file's SHA-256, a link's target, a directory."""
    out: dict[str, str] = {}
    if not root.exists() and not root.is_symlink():
        return out
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st_ = p.lstat()
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISDIR(st_.st_mode):
                out[rel] = "dir"
            elif stat.S_ISREG(st_.st_mode):
                out[rel] = _file_digest(p, st_)
            else:
                out[rel] = f"special:{stat.S_IFMT(st_.st_mode)}"
    return out


def _file_digest(p: Path, st_: os.stat_result) -> str:
    if st_.st_size > 64 * MiB:  # a sparse decoy: never read whole
        return f"big:{st_.st_size}:{st_.st_mtime_ns}"
    return hashlib.sha256(p.read_bytes()).hexdigest()


def rehash(ckpt: Path) -> None:
    """The manifest's sizes and checksums recomputed for the files as they are now (what a forger does)."""
    from tests.reliability.corrupt import rehash as refresh

    try:
        refresh(ckpt)
    except Exception:
        pass


# ----------------------------------------------------------------------------------------------- DCP .metadata
def norm_fqn(fqn: object) -> str:
    """The run checkpoint's key of a plain folder's (``optimizer.state.`` -> ``optim.state.``): picks resolve to
    the same tensors in both copies."""
    s = str(fqn)
    return "optim.state." + s[len("optimizer.state.") :] if s.startswith("optimizer.state.") else s


_PATHS = [
    "../__0_0.distcp",
    "/etc/hostname",
    "",
    ".",
    "..",
    "missing.distcp",
    ".metadata",
    "sub/__0_0.distcp",
    "manifest.json",
    5,
    None,
]
_DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int8", "uint8", "bool", "complex64", "none"]
_NEW_NAMES = ["model.model.extra.weight", "", "model.", "../model.lm_head.weight", "optim.state.x.exp_avg"]

metadata_op = st.one_of(
    st.tuples(st.just("chunk"), pick, pick, st.sampled_from(["offsets", "sizes"]), pick, value, st.booleans()),
    st.tuples(st.just("record"), pick, st.sampled_from(["offset", "length"]), value),
    st.tuples(st.just("record_path"), pick, st.integers(0, len(_PATHS))),
    st.tuples(st.just("dtype"), pick, st.sampled_from(_DTYPES)),
    st.tuples(st.just("shape"), pick, pick, value),
    st.tuples(st.just("ndim"), pick, st.booleans()),
    st.tuples(st.just("rename"), pick, st.integers(0, len(_NEW_NAMES)), pick, st.booleans()),
    st.tuples(st.just("drop_chunk"), pick, pick),
    st.tuples(st.just("dup_chunk"), pick, pick),
    st.tuples(st.just("drop_entry"), pick),
    st.tuples(st.just("drop_record"), pick),
    st.tuples(st.just("swap_records"), pick, pick),
    st.tuples(st.just("kind"), pick),
    raw_op(),
)


def _size(values: list) -> Any:
    import torch

    if all(type(v) is int and -(2**63) <= v < 2**63 for v in values):
        return torch.Size(values)
    return tuple(values)


def _entries(md: Any) -> list:
    return sorted(md.state_dict_metadata, key=norm_fqn)


def _tensor_entries(md: Any) -> list:
    return [k for k in _entries(md) if hasattr(md.state_dict_metadata[k], "chunks")]


def _records(md: Any) -> list:
    return sorted(md.storage_data, key=lambda i: (norm_fqn(i.fqn), repr(i.offset)))


def _nth(items: list, i: int) -> Any:
    return items[i % len(items)] if items else None


def _index(fqn: Any, offsets: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    try:
        return MetadataIndex(fqn, offsets)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None


def _op_chunk(md: Any, t: int, c: int, field: str, dim: int, spec: list, rekey: bool) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    fqn = _nth(_tensor_entries(md), t)
    chunks = md.state_dict_metadata[fqn].chunks if fqn is not None else None
    if not chunks:
        return
    i = c % len(chunks)
    old = chunks[i]
    values = list(getattr(old, field))
    if values:
        values[dim % len(values)] = resolve(spec, values[dim % len(values)])
    else:
        values = [resolve(spec, 0)]
    new = ChunkStorageMetadata(
        offsets=_size(values) if field == "offsets" else old.offsets,
        sizes=_size(values) if field == "sizes" else old.sizes,
    )
    chunks[i] = new
    if rekey and field == "offsets":
        key, info = _index(fqn, old.offsets), None
        if key is not None:
            info = md.storage_data.pop(key, None)
        new_key = _index(fqn, new.offsets)
        if info is not None and new_key is not None:
            md.storage_data[new_key] = info


def _op_record(md: Any, r: int, field: str, spec: list) -> None:
    key = _nth(_records(md), r)
    if key is not None:
        info = md.storage_data[key]
        setattr(info, field, resolve(spec, getattr(info, field)))


def _op_record_path(md: Any, r: int, choice: int) -> None:
    recs = _records(md)
    key = _nth(recs, r)
    if key is None:
        return
    if choice == len(_PATHS):  # another record's file
        other = md.storage_data[_nth(recs, r + 1 + choice)].relative_path
        md.storage_data[key].relative_path = other
    else:
        md.storage_data[key].relative_path = _PATHS[choice]


def _op_dtype(md: Any, t: int, name: str) -> None:
    import torch

    fqn = _nth(_tensor_entries(md), t)
    if fqn is not None:
        md.state_dict_metadata[fqn].properties.dtype = None if name == "none" else getattr(torch, name)


def _op_shape(md: Any, t: int, dim: int, spec: list) -> None:
    fqn = _nth(_tensor_entries(md), t)
    if fqn is None:
        return
    meta = md.state_dict_metadata[fqn]
    values = list(meta.size)
    if values:
        values[dim % len(values)] = resolve(spec, values[dim % len(values)])
    else:
        values = [resolve(spec, 1)]
    meta.size = _size(values)


def _op_ndim(md: Any, t: int, up: bool) -> None:
    fqn = _nth(_tensor_entries(md), t)
    if fqn is not None:
        meta = md.state_dict_metadata[fqn]
        meta.size = _size(list(meta.size) + [1] if up else list(meta.size)[:-1])


def _op_rename(md: Any, t: int, choice: int, other: int, records_too: bool) -> None:
    """Rename an entry: to a new name, or (the last choice) to another entry's (the two collide, one is lost); its
    storage records follow unless ``records_too`` is False."""
    entries = _entries(md)
    old = _nth(entries, t)
    if old is None:
        return
    new = _nth(entries, other) if choice == len(_NEW_NAMES) else _NEW_NAMES[choice]
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    if records_too:
        for key in [k for k in md.storage_data if k.fqn == old]:
            moved = _index(new, key.offset)
            info = md.storage_data.pop(key)
            if moved is not None:
                md.storage_data[moved] = info


def _op_drop_chunk(md: Any, t: int, c: int) -> None:
    fqn = _nth(_tensor_entries(md), t)
    if fqn is not None and md.state_dict_metadata[fqn].chunks:
        chunks = md.state_dict_metadata[fqn].chunks
        chunks.pop(c % len(chunks))


def _op_dup_chunk(md: Any, t: int, c: int) -> None:
    fqn = _nth(_tensor_entries(md), t)
    if fqn is not None and md.state_dict_metadata[fqn].chunks:
        chunks = md.state_dict_metadata[fqn].chunks
        chunks.append(chunks[c % len(chunks)])


def _op_drop_entry(md: Any, t: int) -> None:
    fqn = _nth(_entries(md), t)
    if fqn is not None:
        del md.state_dict_metadata[fqn]


def _op_drop_record(md: Any, r: int) -> None:
    key = _nth(_records(md), r)
    if key is not None:
        del md.storage_data[key]


def _op_swap_records(md: Any, a: int, b: int) -> None:
    recs = _records(md)
    ka, kb = _nth(recs, a), _nth(recs, b)
    if ka is not None:
        md.storage_data[ka], md.storage_data[kb] = md.storage_data[kb], md.storage_data[ka]


def _op_kind(md: Any, t: int) -> None:
    """A tensor entry made a byte value, or a byte value a one-element tensor."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    fqn = _nth(_entries(md), t)
    if fqn is None:
        return
    if hasattr(md.state_dict_metadata[fqn], "chunks"):
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
    else:
        md.state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([1]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))],
        )


_METADATA_OPS: dict[str, Callable[..., None]] = {
    "chunk": _op_chunk,
    "record": _op_record,
    "record_path": _op_record_path,
    "dtype": _op_dtype,
    "shape": _op_shape,
    "ndim": _op_ndim,
    "rename": _op_rename,
    "drop_chunk": _op_drop_chunk,
    "dup_chunk": _op_dup_chunk,
    "drop_entry": _op_drop_entry,
    "drop_record": _op_drop_record,
    "swap_records": _op_swap_records,
    "kind": _op_kind,
}


def mutate_metadata(ckpt: Path, ops: list) -> None:
    """Apply ``ops`` to ``ckpt/.metadata``: the structured ones to DCP's own classes (the seed is a file this suite
    wrote: the standard unpickler is fine), re-pickled as DCP pickles it, then the raw ones to its bytes."""
    path = ckpt / ".metadata"
    data = regular_bytes(path)
    if data is None:
        return
    structured = [op for op in ops if not is_raw(op)]
    if structured:
        try:
            md = pickle.loads(data)
        except Exception:
            md = None
        for op in structured if md is not None else []:
            _METADATA_OPS[op[0]](md, *op[1:])
        data = pickle.dumps(md) if md is not None else data
    path.write_bytes(apply_raw(data, [op for op in ops if is_raw(op)]))


# ----------------------------------------------------------------------------------------------- JSON (manifest)
_JSON_STRINGS = [
    "",
    "x",
    "../x",
    "/etc/hostname",
    "step-00000002",
    "float32",
    "__0_0.distcp",
    "0" * 32,
    "fsdp2",
    "deepspeed",
    "a" * 300,
]
json_value = st.one_of(
    st.tuples(st.just("int"), st.sampled_from(INTS)),
    st.tuples(st.just("delta"), st.integers(-3, 3)),
    st.tuples(st.just("str"), st.sampled_from(_JSON_STRINGS)),
    st.tuples(st.just("odd"), st.sampled_from(["none", "float", "list", "bool", "dict"])),
)
_FILE_PATHS = [
    "../x",
    "/etc/hostname",
    "a/../../b",
    "",
    ".",
    "sub/x",
    "x\u0000y",
    "__0_0.distcp",
    ".metadata",
    "manifest.json",
    "a" * 300,
    "__9_0.distcp",
]
manifest_op = st.one_of(
    st.tuples(st.just("set"), pick, json_value),
    st.tuples(st.just("drop"), pick),
    st.tuples(st.just("file_path"), pick, st.integers(0, len(_FILE_PATHS) - 1)),
    st.tuples(st.just("file_dup"), pick),
    st.tuples(st.just("file_drop"), pick),
    st.tuples(st.just("file_swap"), pick, pick),
    raw_op(),
)


def json_nodes(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out: list[tuple] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        out += json_nodes(v, prefix + (k,))
    return out


def _parent(obj: Any, path: tuple) -> Any:
    for k in path[:-1]:
        obj = obj[k]
    return obj


def _json_resolve(spec: list, orig: Any) -> Any:
    if spec[0] == "str":
        return spec[1]
    if spec[0] == "delta":
        return orig + spec[1] if type(orig) is int else (orig + spec[1] if type(orig) is float else spec[1])
    return resolve(spec, orig)


def mutate_json(obj: Any, ops: list) -> Any:
    for op in ops:
        kind = op[0]
        files = obj.get("files") if isinstance(obj, dict) else None
        if kind in ("set", "drop"):
            nodes = json_nodes(obj)
            path = _nth(nodes, op[1])
            if path is None:
                continue
            parent = _parent(obj, path)
            if kind == "set":
                parent[path[-1]] = _json_resolve(op[2], parent[path[-1]])
            else:
                del parent[path[-1]]
        elif isinstance(files, list) and files and all(isinstance(f, dict) for f in files):
            i = op[1] % len(files)
            if kind == "file_path":
                files[i]["path"] = _FILE_PATHS[op[2]]
            elif kind == "file_dup":
                files.append(dict(files[i]))
            elif kind == "file_drop":
                files.pop(i)
            elif kind == "file_swap":
                j = op[2] % len(files)
                files[i]["path"], files[j]["path"] = files[j].get("path"), files[i].get("path")
    return obj


def mutate_manifest(ckpt: Path, ops: list) -> None:
    path = ckpt / "manifest.json"
    structured = [op for op in ops if not is_raw(op)]
    text = regular_bytes(path)
    if text is None:
        return
    if structured:
        try:
            text = json.dumps(mutate_json(json.loads(text), structured)).encode()
        except ValueError:  # an earlier program's raw edit made it no JSON: only raw edits apply
            pass
    path.write_bytes(apply_raw(text, [op for op in ops if is_raw(op)]))


# manifest fields that describe the files and the state they hold: a verdict of valid needs them unchanged
# (the run id is not among them: it says whose run wrote the checkpoint, which the memory tier checks, ``ownership``)
CLAIMS = (
    "schema_version",
    "format",
    "step",
    "tokens",
    "samples",
    "files",
    "tensors",
    "model_signature",
    "topology",
    "fingerprint",
    "source_world_size",
)


def claims(raw: bytes) -> Any:
    """What a manifest says about its checkpoint (the order of its lists, a file listed twice and rank numbers
    aside), or the bytes when not JSON."""
    try:
        m = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(m, dict):
        return raw
    out = {k: m.get(k, "<absent>") for k in CLAIMS}
    files = out["files"]
    if isinstance(files, list) and all(isinstance(f, dict) for f in files):
        out["files"] = sorted({json.dumps({k: v for k, v in f.items() if k != "rank"}, sort_keys=True) for f in files})
    tensors = out["tensors"]
    if isinstance(tensors, list):
        out["tensors"] = sorted(json.dumps(t, sort_keys=True) for t in tensors)
    topo = out["topology"]
    if isinstance(topo, dict):
        out["topology"] = (topo.get("nodes"), topo.get("procs_per_node"))
    fp = out["fingerprint"]
    if isinstance(fp, dict):
        out["fingerprint"] = {k: fp.get(k) for k in ("model", "optim", "optim_step")}
    return json.dumps(out, sort_keys=True, default=str)


# ----------------------------------------------------------------------------------------------- DeepSpeed files
MODEL_STATES = "mp_rank_00_model_states.pt"


def optim_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


_DS_FILES = [MODEL_STATES, optim_name(0), optim_name(1)]
deepspeed_op = st.one_of(
    st.tuples(st.just("ms"), st.sampled_from(["dp_world_size", "global_steps", "mp_world_size"]), value),
    st.tuples(
        st.just("shape"),
        pick,
        pick,
        st.sampled_from(["dim", "drop", "rename", "swap", "extra", "group_drop"]),
        pick,
        value,
    ),
    st.tuples(st.just("slice"), pick, pick, pick, st.sampled_from(["start", "numel"]), value),
    st.tuples(st.just("slice_swap"), pick, pick, pick, pick),
    st.tuples(st.just("slice_drop"), pick, pick, pick),
    st.tuples(st.just("stage"), pick, value),
    st.tuples(
        st.just("flat"),
        pick,
        pick,
        st.sampled_from(["fp32", "exp_avg", "exp_avg_sq"]),
        st.sampled_from(["trunc", "half", "2d", "drop", "scalar", "grow"]),
    ),
    st.tuples(st.just("step"), pick, value),
    st.tuples(st.just("pcount"), pick, value),
    st.tuples(st.just("zraw"), st.integers(0, 2), raw_op("z")),
)


def _ds_group_state(osd: dict, g: int) -> dict:
    return osd["optimizer_state_dict"]["base_optimizer_state"]["state"][g]


def _ds_apply(objs: dict[str, Any], op: list) -> None:
    import torch

    ms = objs[MODEL_STATES]
    kind = op[0]
    if kind == "ms":
        ms[op[1]] = resolve(op[2], ms.get(op[1]))
        return
    if kind == "shape":
        groups = ms["param_shapes"]
        g = op[1] % len(groups)
        names = list(groups[g])
        if op[3] == "group_drop":
            groups.pop(g)
            return
        name = _nth(names, op[2])
        if name is None:
            return
        if op[3] == "dim":
            dims = list(groups[g][name]) or [1]
            dims[op[4] % len(dims)] = resolve(op[5], dims[op[4] % len(dims)])
            groups[g][name] = _size(dims)
        elif op[3] == "drop":
            del groups[g][name]
        elif op[3] == "rename":
            groups[g] = {("model.renamed.weight" if k == name else k): v for k, v in groups[g].items()}
        elif op[3] == "swap":
            other = _nth(names, op[4])
            groups[g][name], groups[g][other] = groups[g][other], groups[g][name]
        else:
            groups[g]["model.extra.weight"] = _size([resolve(op[5], 4)])
        return
    osd = objs[optim_name(op[1] % 2)]["optimizer_state_dict"]
    if kind in ("slice", "slice_swap", "slice_drop"):
        maps = osd["param_slice_mappings"]
        m = maps[op[2] % len(maps)]
        name = _nth(list(m), op[3])
        if name is None:
            return
        if kind == "slice":
            m[name] = dataclasses.replace(m[name], **{op[4]: resolve(op[5], getattr(m[name], op[4]))})
        elif kind == "slice_swap":
            other = _nth(list(m), op[4])
            m[name], m[other] = m[other], m[name]
        else:
            del m[name]
    elif kind == "stage":
        osd["zero_stage"] = resolve(op[2], 2)
    elif kind == "pcount":
        osd["partition_count"][0] = resolve(op[2], osd["partition_count"][0])
    elif kind == "step":
        st_ = _ds_group_state(objs[optim_name(op[1] % 2)], 0)
        v = resolve(op[2], 2)
        st_["step"] = torch.tensor(float(v)) if type(v) is int and abs(v) < 2**63 else v
    elif kind == "flat":
        g = op[2] % 2
        if op[3] == "fp32":
            holder, key = osd["single_partition_of_fp32_groups"], g
        else:
            holder, key = _ds_group_state(objs[optim_name(op[1] % 2)], g), op[3]
        t = holder[key]
        how = op[4]
        if how == "drop":
            del holder[key]
        else:
            holder[key] = {
                "trunc": lambda: t[:-1].clone(),
                "half": lambda: t.half(),
                "2d": lambda: t.view(2, -1).clone(),
                "scalar": lambda: t[0].clone(),
                "grow": lambda: torch.cat([t, t]),
            }[how]()


def mutate_deepspeed(tag: Path, ops: list) -> None:
    """Apply ``ops`` to the DeepSpeed files in ``tag`` (a ``global_stepN/`` or a shardkeeper step dir): the dict
    edits through torch.load/torch.save of the seed (files this suite wrote), then the raw bytes of the zips."""
    import torch

    structured = [op for op in ops if op[0] != "zraw"]
    if structured:
        objs = {name: torch.load(tag / name, weights_only=False) for name in _DS_FILES}  # noqa: S614 - the seed
        for op in structured:
            try:
                _ds_apply(objs, op)
            except (KeyError, IndexError, TypeError, AttributeError):
                pass  # an earlier edit removed what this one edits
        for name, obj in objs.items():
            torch.save(obj, tag / name)
    for op in ops:
        if op[0] == "zraw":
            path = tag / _DS_FILES[op[1]]
            path.write_bytes(apply_raw(path.read_bytes(), [op[2]]))


# ----------------------------------------------------------------------------------------------- latest, layout
_LATEST = [
    "global_step2",
    "global_step2\n",
    "  global_step2  \n",
    "global_step3",
    "global_step",
    "../global_step2",
    "/global_step2",
    "",
    "\0",
    "global_step02",
    "global_step2/",
    "global_step-2",
    "global_step" + "9" * 30,
    "x" * 5000,
    "global_step2\nglobal_step3",
    "\udcff",
]
latest_op = st.one_of(
    st.tuples(st.just("text"), st.integers(0, len(_LATEST) - 1)),
    st.tuples(
        st.just("kind"),
        st.sampled_from(["link_tag", "link_missing", "link_self", "dir", "fifo", "sparse", "empty", "absent"]),
    ),
    raw_op(),
)
_LAYOUT_NAMES = [
    optim_name(2),
    "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    "bf16_" + optim_name(0),
    "mp_rank_01_model_states.pt",
    "expert_mp_rank_00_model_states.pt",
    "optimizer.pt",
    "model.safetensors",
    "pytorch_model.bin",
    ".metadata",
    "x.pt",
    optim_name(0),
    optim_name(1),
    MODEL_STATES,
]
_TAG_NAMES = [
    "global_step7",
    "global_step02",
    "global_step_2",
    "step-2",
    "checkpoint-2",
    "global_step2x",
    "global_step1",
]
layout_op = st.one_of(
    st.tuples(st.just("rm"), pick),
    st.tuples(st.just("mv"), pick, st.integers(0, len(_LAYOUT_NAMES) - 1)),
    st.tuples(st.just("cp"), pick, st.integers(0, len(_LAYOUT_NAMES) - 1)),
    st.tuples(st.just("link"), pick, st.sampled_from(["sibling", "outside", "dangling", "dir", "devzero"])),
    st.tuples(st.just("special"), pick, st.sampled_from(["fifo", "dir", "empty", "sparse"])),
    st.tuples(
        st.just("tag"),
        st.sampled_from(["rename", "decoy", "nest", "link_outside"]),
        st.integers(0, len(_TAG_NAMES) - 1),
    ),
    st.tuples(st.just("trainer_state"), json_value),
)


def _files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _remove(path: Path) -> None:
    """Whatever is at ``path`` (a file, link, fifo or directory tree) removed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _special(path: Path, kind: str) -> None:
    _remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # no block allocated: reading it whole would take a GiB of memory


def _copy_tree(src: Path, dst: Path) -> None:
    """``src``'s entries copied over ``dst`` as they are (shutil.copytree cannot copy a fifo an earlier mutation
    made, and follows links -- into a loop, or reading /dev/zero): links copied as links, never followed, fifos
    made anew, whatever was at a name replaced."""
    if not dst.is_dir() or dst.is_symlink():
        _remove(dst)
        dst.mkdir(parents=True)
    for entry in os.scandir(src):
        s, d = Path(entry.path), dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            _copy_tree(s, d)
            continue
        _remove(d)
        if entry.is_symlink():
            d.symlink_to(os.readlink(s))
        elif entry.is_file(follow_symlinks=False):
            shutil.copy2(s, d)
        elif stat.S_ISFIFO(entry.stat(follow_symlinks=False).st_mode):
            os.mkfifo(d)


def mutate_latest(ckpt: Path, ops: list, outside: Path) -> None:
    path = ckpt / "latest"
    for op in ops:
        if op[0] == "text":
            _remove(path)
            path.write_bytes(_LATEST[op[1]].encode("utf-8", "surrogateescape"))
        elif op[0] == "kind":
            kind = op[1]
            if kind in ("fifo", "dir", "empty", "sparse"):
                _special(path, kind)
                continue
            _remove(path)
            if kind == "link_tag":
                path.symlink_to(f"global_step{fc.DS_STEP}")
            elif kind == "link_missing":
                path.symlink_to(outside / "nothing")
            elif kind == "link_self":
                path.symlink_to("latest")
        elif path.is_file() and not path.is_symlink() and path.stat().st_size <= 1 << 20:
            # a sparse GiB stays as it is: editing it here would count its bytes against the reader's memory bound
            path.write_bytes(apply_raw(path.read_bytes(), [op]))


def mutate_layout(ckpt: Path, ops: list, outside: Path) -> None:
    for op in ops:
        files = _files_of(ckpt)
        if op[0] in ("rm", "mv", "cp", "link", "special"):
            target = _nth(files, op[1])
            if target is None:
                continue
            if op[0] == "rm":
                target.unlink()
            elif op[0] in ("mv", "cp"):
                dst = target.with_name(_LAYOUT_NAMES[op[2]])
                if dst == target:
                    continue
                _remove(dst)
                (shutil.copyfile if op[0] == "cp" else os.replace)(target, dst)
            elif op[0] == "link":
                kind = op[2]
                if kind == "outside":
                    outside.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(target, outside / target.name)
                dest = {
                    "sibling": _nth([f for f in files if f != target], op[1] + 1) or target.parent,
                    "outside": outside / target.name,
                    "dangling": outside / "nothing",
                    "dir": target.parent,
                    "devzero": Path("/dev/zero"),
                }[kind]
                target.unlink()
                target.symlink_to(dest)
            else:
                _special(target, op[2])
        elif op[0] == "tag":
            tag = ckpt / f"global_step{fc.DS_STEP}"
            if not tag.is_dir() or tag.is_symlink():
                continue
            name = _TAG_NAMES[op[2]]
            if op[1] == "rename":
                tag.rename(ckpt / name)
            elif op[1] == "decoy":
                _copy_tree(tag, ckpt / name)
            elif op[1] == "nest" and not os.path.lexists(tag / tag.name):
                _copy_tree(tag, outside / "nest")  # never into itself: a copy of a tree it is copying
                shutil.move(str(outside / "nest"), tag / tag.name)
            else:
                outside.mkdir(parents=True, exist_ok=True)
                shutil.move(str(tag), outside / tag.name)
                tag.symlink_to(outside / tag.name)
        elif op[0] == "trainer_state":
            path = ckpt / "trainer_state.json"
            state = {"global_step": _json_resolve(op[1], fc.DS_STEP), "log_history": []}
            _remove(path)
            path.write_text(json.dumps(state))


# ----------------------------------------------------------------------------------------------- memory snapshots
memory_op = st.one_of(
    st.tuples(st.just("manifest"), st.lists(manifest_op, min_size=1, max_size=2)),
    st.tuples(st.just("metadata"), st.lists(metadata_op, min_size=1, max_size=2), st.booleans()),
    st.tuples(
        st.just("file"), pick, st.sampled_from(["flip", "trunc", "delete", "empty", "link_outside", "fifo"]), pick
    ),
    st.tuples(st.just("stray"), st.sampled_from(["stray.bin", ".metadata.tmp", "__9_0.distcp", "manifest.json.tmp"])),
    st.tuples(
        st.just("tier"),
        st.sampled_from(
            [
                "other_run_dir",
                "other_id",
                "no_id",
                "id_int",
                "not_json",
                "absent",
                "empty",
                "dir",
                "spaces",
                "list",
                "fifo",
            ]
        ),
    ),
    st.tuples(st.just("run_id"), st.sampled_from(["other", "empty", "absent", "garbage", "spaces", "fifo", "two"])),
    st.tuples(
        st.just("rename"),
        st.sampled_from(
            ["step-00000004", "step-3", "step-00000003.partial", "step-00000003.invalid-1", "step-00000001"]
        ),
    ),
)


def mutate_memory(run: Path, shm: Path, ops: list, outside: Path) -> None:
    snap = shm / "checkpoints" / fc.step_name(fc.SNAP_STEP)
    for op in ops:
        if not snap.is_dir():
            break
        kind = op[0]
        if kind == "manifest":
            mutate_manifest(snap, op[1])
        elif kind == "metadata":
            mutate_metadata(snap, op[1])
            if op[2]:
                rehash(snap)
        elif kind == "file":
            target = _nth(_files_of(snap), op[1])
            if target is None:
                continue
            how = op[2]
            if how == "flip":
                data = bytearray(target.read_bytes())
                if data:
                    data[op[3] % len(data)] ^= 0xFF
                target.write_bytes(bytes(data))
            elif how == "trunc":
                data = target.read_bytes()
                target.write_bytes(data[: op[3] % max(1, len(data))])
            elif how == "delete":
                target.unlink()
            elif how == "empty":
                target.write_bytes(b"")
            elif how == "link_outside":
                outside.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(target, outside / target.name)
                target.unlink()
                target.symlink_to(outside / target.name)
            else:
                _special(target, "fifo")
        elif kind == "stray":
            (snap / op[1]).write_bytes(b"x")
        elif kind == "tier":
            _mutate_tier(shm / "tier.json", op[1], outside)
        elif kind == "run_id":
            _mutate_run_id(run / ".run-id", op[1])
        elif kind == "rename":
            new = snap.with_name(op[1])
            snap.rename(new)
            snap = new


def _mutate_tier(path: Path, how: str, outside: Path) -> None:
    try:
        owner = json.loads(regular_bytes(path) or b"")
    except ValueError:
        owner = {}
    if not isinstance(owner, dict):
        owner = {}
    if how in ("absent", "empty", "dir", "not_json", "list", "fifo"):
        _remove(path)
        if how == "fifo":
            os.mkfifo(path)
        elif how == "list":
            path.write_text(json.dumps([owner]))
        elif how == "empty":
            path.write_text("")
        elif how == "dir":
            path.mkdir()
        elif how == "not_json":
            path.write_text("{run_dir")
        return
    if os.path.lexists(path) and not stat.S_ISREG(path.lstat().st_mode):
        return  # a folder, fifo or link made by an earlier edit stays what it is: the reader meets it, not this edit
    if how == "other_run_dir":
        owner["run_dir"] = str(outside / "run")
    elif how == "other_id":
        owner["id"] = "0" * 32
    elif how == "no_id":
        owner.pop("id", None)
    elif how == "id_int":
        owner["id"] = 5
    path.write_text(json.dumps(owner, indent=4) if how == "spaces" else json.dumps(owner))


def _mutate_run_id(path: Path, how: str) -> None:
    try:
        old = path.read_bytes().decode("utf-8", "replace").strip() if stat.S_ISREG(path.lstat().st_mode) else ""
    except OSError:
        old = ""
    _remove(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "two":
        path.write_text(f"{old} {old}\n")
    elif how == "other":
        path.write_text("f" * 32 + "\n")
    elif how == "empty":
        path.write_text("")
    elif how == "garbage":
        path.write_bytes(b"\xff\xfe\x00 not an id")
    elif how == "spaces":
        path.write_text(f"  {old}  \n\n")


def ownership(run: Path, shm: Path) -> tuple:
    """Whose the memory dir and the run are, as their readers parse them (whitespace aside); a snapshot's own run id
    is ``snapshot_run_id``."""

    def text(p: Path) -> str | None:
        data = regular_bytes(p)
        try:
            return None if data is None else data.decode().strip()
        except UnicodeDecodeError:
            return None

    def parsed(p: Path) -> Any:
        try:
            return json.loads(regular_bytes(p) or b"")
        except ValueError:
            return None

    return text(run / ".run-id"), parsed(shm / "tier.json")


def snapshot_run_id(snap: Path) -> Any:
    """The run id a snapshot's manifest names; None when it names none (a snapshot of an earlier version, which the
    memory dir's owner vouches for)."""
    try:
        m = json.loads(regular_bytes(snap / "manifest.json") or b"")
    except ValueError:
        return "<unreadable>"
    return m.get("run_id") if isinstance(m, dict) else "<unreadable>"


# ----------------------------------------------------------------------------------------------- reference readers
class _MetadataUnpickler(pickle.Unpickler):
    """The classes a DCP ``.metadata`` names (the reference reader's own allow-list, not the product's)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        pairs = (("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"))
        if (
            module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
            or (module, name) in pairs
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ):
            found = super().find_class(module, name)
            if (
                isinstance(found, type)
                or (module, name) == ("torch.serialization", "_get_layout")
                or name == "_MEM_FORMAT_ENCODING"
                or isinstance(found, torch.dtype)
            ):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP .metadata")


class Malformed(Exception):
    """The reference reader's verdict: the files do not form a well-made checkpoint."""


def _plain_record(md: Any, ckpt: Path, fqn: str, offsets: Any) -> bytes:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data.get(MetadataIndex(fqn, offsets))
    if info is None:
        raise Malformed(f"no record of {fqn} at {offsets}")
    name, start, length = info.relative_path, info.offset, info.length
    if type(name) is not str or not name or "/" in name or name in (".", "..") or "\0" in name:
        raise Malformed(f"record of {fqn} names {name!r}")
    path = ckpt / name
    st_ = os.lstat(path)
    if not stat.S_ISREG(st_.st_mode):
        raise Malformed(f"{name} is not a regular file")
    if type(start) is not int or type(length) is not int or start < 0 or length < 0 or start + length > st_.st_size:
        raise Malformed(f"record of {fqn} at {start}+{length} outside {name} ({st_.st_size} bytes)")
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(length)


def dcp_reference(ckpt: Path) -> tuple[str | None, dict[str, Any]]:
    """What a DCP checkpoint's files say, read the plain way: ``.metadata`` through its own allow-list, every record
    with ``torch.load(weights_only=True)``, every element of every tensor counted. Returns (None, {key: tensor or
    value}) when the files form a well-made checkpoint (every chunk inside its tensor, the chunks tiling it, every
    record inside its file holding a tensor of its chunk's dtype and size), else (why not, {})."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorStorageMetadata,
    )

    try:
        data = regular_bytes(ckpt / ".metadata")
        if data is None:
            raise Malformed(".metadata is not a regular file")
        md = _MetadataUnpickler(io.BytesIO(data)).load()
        out: dict[str, Any] = {}
        for fqn, meta in md.state_dict_metadata.items():
            if type(fqn) is not str:
                raise Malformed(f"entry {fqn!r} is not a name")
            if type(meta) is BytesStorageMetadata:
                out[fqn] = torch.load(io.BytesIO(_plain_record(md, ckpt, fqn, None)), weights_only=True)
                continue
            if type(meta) is not TensorStorageMetadata:
                raise Malformed(f"{fqn}: {type(meta).__name__}")
            out[fqn] = _reference_tensor(md, ckpt, fqn, meta)
        return None, out
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", {}


def _reference_tensor(md: Any, ckpt: Path, fqn: str, meta: Any) -> Any:
    import torch

    shape, dtype = tuple(meta.size), meta.properties.dtype
    if (
        not isinstance(dtype, torch.dtype)
        or not all(type(d) is int and 0 <= d for d in shape)
        or math.prod(shape) > 1 << 22
    ):
        raise Malformed(f"{fqn}: shape {shape} dtype {dtype}")
    full = torch.zeros(shape, dtype=dtype)
    count = torch.zeros(shape, dtype=torch.int32)
    for chunk in meta.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or not all(
                type(o) is int and type(n) is int and o >= 0 and n >= 0 and o + n <= d
                for o, n, d in zip(offsets, sizes, shape)
            )
        ):
            raise Malformed(f"{fqn}: chunk {offsets} {sizes} outside {shape}")
        t = torch.load(io.BytesIO(_plain_record(md, ckpt, fqn, chunk.offsets)), weights_only=True)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != math.prod(sizes):
            raise Malformed(
                f"{fqn}: the record of chunk {offsets} holds {getattr(t, 'dtype', type(t))} "
                f"{list(getattr(t, 'shape', []))}"
            )
        region, counted = full, count
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            region, counted = region.narrow(d, o, n), counted.narrow(d, o, n)
        region.copy_(t.reshape(sizes))
        counted += 1
    if not bool((count == 1).all()):
        raise Malformed(f"{fqn}: chunks do not tile {shape}")
    return full


_DS_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def _ds_load(path: Path) -> Any:
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise Malformed(f"{path.name} is not a regular file")
    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, weights_only=True, map_location="cpu")


def ds_reference(tag: Path) -> tuple[str | None, dict[str, Any]]:
    """What a DeepSpeed ZeRO-1/2 checkpoint's files say, the way ``deepspeed.utils.zero_to_fp32`` reads them, written
    out here with ``torch.load(weights_only=True)``: per parameter of ``param_shapes``, its pieces in the ranks' flat
    fp32 and moment partitions (``param_slice_mappings``), which must add up to its shape, lie inside the partition
    and not overlap. Returns (None, {"tensors": {name: {fp32, exp_avg, exp_avg_sq}}, "steps": [...]}) or (why, {})."""
    import torch

    try:
        ms = _ds_load(tag / MODEL_STATES)
        world = ms["dp_world_size"]
        if type(world) is not int or not 1 <= world <= 64:
            raise Malformed(f"dp_world_size {world!r}")
        optims = [_ds_load(tag / optim_name(r))["optimizer_state_dict"] for r in range(world)]
        if any(int(o["zero_stage"]) not in (1, 2) or type(o["zero_stage"]) is bool for o in optims):
            raise Malformed("not ZeRO stage 1 or 2")
        tensors: dict[str, dict[str, Any]] = {}
        for g, shapes in enumerate(ms["param_shapes"]):
            used: list[list[tuple[int, int]]] = [[] for _ in range(world)]
            for name, shape in shapes.items():
                parts: dict[str, list[Any]] = {k: [] for k in _DS_KEYS}
                total = 0
                for r, osd in enumerate(optims):
                    addr = osd["param_slice_mappings"][g].get(name)
                    if addr is None:
                        continue
                    start, numel = addr.start, addr.numel
                    if type(start) is not int or type(numel) is not int or start < 0 or numel < 0:
                        raise Malformed(f"slice of {name}: {start} {numel}")
                    for k in _DS_KEYS:
                        flat = (
                            osd["single_partition_of_fp32_groups"][g]
                            if k == "fp32"
                            else osd["base_optimizer_state"]["state"][g][k]
                        )
                        if flat.dim() != 1 or flat.dtype != torch.float32 or start + numel > flat.numel():
                            raise Malformed(f"{k} partition of group {g} on rank {r}")
                        parts[k].append(flat[start : start + numel])
                    used[r].append((start, start + numel))
                    total += numel
                if not all(type(d) is int and d >= 0 for d in shape) or total != math.prod(shape):
                    raise Malformed(f"{name}: {total} elements for {list(shape)}")
                tensors[name] = {k: torch.cat(parts[k]).view(tuple(shape)) for k in _DS_KEYS}
            for spans in used:
                spans.sort()
                if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
                    raise Malformed(f"slices overlap in group {g}")
        steps = [float(osd["base_optimizer_state"]["state"][0]["step"]) for osd in optims[:1]]
        return None, {"tensors": tensors, "steps": steps, "global_steps": ms.get("global_steps")}
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}", {}


def same(a: Any, b: Any) -> bool:
    """Bit for bit (tensors: dtype, shape and every byte; NaNs included), or equal values."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8)))
    return bool(a == b)


def sums_of_squares(values: dict[str, Any]) -> dict[str, float]:
    import torch

    return {
        k: float(v.double().pow(2).sum())
        for k, v in values.items()
        if isinstance(v, torch.Tensor)
        and v.is_floating_point()
        and (k.startswith("model.") or k.endswith(("exp_avg", "exp_avg_sq")))
    }


def fingerprint_consistent(values: dict[str, Any], seed: dict[str, Any]) -> bool:
    """The per-tensor norms the seed's manifest records (its fingerprint) still describe ``values``."""
    a, b = sums_of_squares(values), sums_of_squares(seed)
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * max(abs(a[k]), abs(b[k]), 1e-30) for k in a)


# ----------------------------------------------------------------------------------------------- the seeds' state
@dataclass
class Seeds:
    """What the unmutated seeds hold (read once by the worker, before it forks any input)."""

    dcp: dict[str, Any]  # the DCP checkpoint's keys (dcp_reference)
    plain_digest: dict[str, str]  # tree_digest of an unmutated plain DCP copy
    ds: dict[str, Any]  # ds_reference of the DeepSpeed checkpoint
    trainer_digest: dict[str, str]  # tree_digest of an unmutated checkpoint-N copy
    snap: dict[str, Any]  # the memory snapshot (step 3)
    stored: dict[str, Any]  # the memory run's storage checkpoint (step 2)


_SEEDS: list[Seeds] = []


def seeds() -> Seeds:
    if not _SEEDS:
        with tempfile.TemporaryDirectory(prefix="fuzz-seeds-") as tmp:
            t = Path(tmp)
            run, _ = fc.memory_copy(t / "mem")
            snap = t / "mem" / "shm" / "checkpoints" / fc.step_name(fc.SNAP_STEP)
            found = [
                dcp_reference(fc.dcp_ckpt(fc.dcp_run_copy(t / "dcp"))),
                ds_reference(fc.ds_ckpt_copy(t / "ds")),
                dcp_reference(snap),
                dcp_reference(run / "checkpoints" / fc.step_name(fc.MEMORY_STORED_STEP)),
            ]
            problems = [why for why, _ in found if why]
            if problems:
                raise RuntimeError(
                    f"the seed corpus does not read back: {problems}; regenerate it "
                    "(python -m tests.reliability.fuzz_corpus)"
                )
            _SEEDS.append(
                Seeds(
                    dcp=found[0][1],
                    plain_digest=tree_digest(fc.plain_dcp_copy(t / "plain")),
                    ds=found[1][1],
                    trainer_digest=tree_digest(fc.trainer_copy(t / "trainer")),
                    snap=found[2][1],
                    stored=found[3][1],
                )
            )
    return _SEEDS[0]


def counters(values: dict[str, Any]) -> tuple:
    return tuple(int(values[k]) if k in values else None for k in ("trainer.step", "trainer.tokens", "trainer.samples"))


def state_keys(values: dict[str, Any]) -> dict[str, Any]:
    """The training state a load or an import carries across: model weights and AdamW moments."""
    return {
        k: v
        for k, v in values.items()
        if k.startswith("model.") or (k.startswith("optim.state.") and k.endswith(("exp_avg", "exp_avg_sq")))
    }


def from_plain(values: dict[str, Any]) -> dict[str, Any]:
    """A plain DCP folder's keys (``optimizer.state.``) under a shardkeeper checkpoint's (``optim.state.``)."""
    return state_keys({norm_fqn(k): v for k, v in values.items()})


def from_ds(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, t in values.get("tensors", {}).items():
        out[f"model.{name}"] = t["fp32"]
        for m in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{m}"] = t[m]
    return out


def result(outcome: str, why: str) -> dict[str, str]:
    return {"outcome": outcome, "why": " ".join(why.split())[:600]}


def matches(got: dict[str, Any], want: dict[str, Any], cast: bool = False) -> str | None:
    """None when ``got`` holds every key of ``want`` with the same value, else the first that differs."""
    for k, v in want.items():
        if k not in got:
            return f"{k} missing"
        if cast and hasattr(v, "float") and getattr(v, "is_floating_point", lambda: False)():
            v = v.float()
        if not same(got[k], v):
            return f"{k} differs"
    return None


# ----------------------------------------------------------------------------------------------- entry points
def run_cli(argv: list[str], tmp: Path) -> tuple[int, list[str]]:
    """``shardkeeper ARGV`` in this process (the CLI's own ``main``), its stdout and stderr captured at the file
    descriptors; returns the exit code and the non-empty lines printed."""
    from shardkeeper.cli import main

    out = tmp / f"cli-{time.monotonic_ns()}.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        rc = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
    return rc, [ln for ln in out.read_text(errors="replace").splitlines() if ln.strip()]


def cli_refusal(rc: int, lines: list[str], names: list[str]) -> str | None:
    """None when the CLI refused as the product promises: exit 2 or 4, exactly one ``error:`` line naming one of
    ``names`` (the input); else what was wrong."""
    if rc not in (2, 4):
        return f"exit {rc}: {lines[-3:]}"
    if len(lines) != 1 or not lines[0].startswith("error: "):
        return f"exit {rc} with {len(lines)} lines: {lines[:4]}"
    if "internal error" in lines[0] or "Traceback" in lines[0]:
        return lines[0]
    if not any(n in lines[0] for n in names):
        return f"the line names none of the input's paths: {lines[0]}"
    return None


def _committed(run: Path) -> list[Path]:
    from ckpt.commit.layout import parse_step

    d = run / "checkpoints"
    return sorted(p for p in d.iterdir() if parse_step(p.name) is not None and "." not in p.name) if d.is_dir() else []


def judge_import(src: Path, tmp: Path, kind: str, intact: bool) -> dict[str, str]:
    """``shardkeeper import SRC``: a refusal in one line (no run directory left), or a committed checkpoint whose
    tensors are the seed's or what the mutated source says; the source untouched either way."""
    before, run = tree_digest(src), tmp / "run"
    rc, lines = run_cli(["import", str(src), "--config", str(fc.CONFIG), "--run-dir", str(run)], tmp)
    if tree_digest(src) != before:
        return result("other", f"import changed its source (exit {rc})")
    if rc != 0:
        why = cli_refusal(rc, lines, [str(src)])
        if why:
            return result("other", f"import: {why}")
        if run.exists():
            return result("other", f"import refused but left {run}: {lines[0]}")
        if intact:
            return result("other", f"import refused a source whose every byte is the seed's: {lines[0]}")
        return result("refused", lines[0])
    return _judge_imported(run, src, kind)


def _judge_imported(run: Path, src: Path, kind: str) -> dict[str, str]:
    done = _committed(run)
    if len(done) != 1:
        return result("other", f"import exited 0 with {len(done)} committed checkpoints")
    why, got = dcp_reference(done[0])
    if why:
        return result("other", f"the imported checkpoint is not well-made: {why}")
    step = json.loads((done[0] / "manifest.json").read_text())["step"]
    s = seeds()
    seed = from_ds(s.ds) if kind == "ds" else state_keys(s.dcp)
    if matches(got, seed) is None and step == fc.DS_STEP:
        return result("correct", "imported the seed's tensors and step")
    declared = _declared(src, kind)
    for values, steps in declared:
        if matches(got, values, cast=True) is None and step in steps:
            return result("correct", "imported exactly what the mutated source says")
    return result(
        "other",
        f"imported step {step} and tensors that are neither the seed's ({matches(got, seed)}) nor "
        f"what the source says ({[matches(got, v, cast=True) for v, _ in declared][:2]})",
    )


def _declared(src: Path, kind: str) -> list[tuple[dict[str, Any], set[int]]]:
    """What the mutated source says, for each checkpoint in it import could have read (well-made ones only)."""
    out = []
    if kind == "dcp":
        why, values = dcp_reference(src)
        if not why:
            steps = {int(v) for k, v in values.items() if k.endswith(".step") and _finite_count(v)}
            out.append((from_plain(values), steps))
        return out
    for d in [src, *sorted(p for p in src.rglob("*") if p.is_dir())]:
        if (d / MODEL_STATES).is_file() and not (d / MODEL_STATES).is_symlink():
            why, values = ds_reference(d)
            if not why:
                steps = {int(s) for s in values["steps"] if math.isfinite(s)}
                if type(values["global_steps"]) is int:
                    steps.add(values["global_steps"])
                out.append((from_ds(values), steps))
    return out


def _finite_count(v: Any) -> bool:
    try:
        return v.numel() == 1 and math.isfinite(float(v)) and float(v) >= 0
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return False


def judge_validate(ck: Path, tmp: Path, *, identical: bool, valid_ok: Callable[[], str | None]) -> dict[str, str]:
    """``shardkeeper validate --deep CKPT``: valid only when ``valid_ok()`` (every byte intact, or a forged manifest
    over files that still form the checkpoint its fingerprint describes); a refusal in one line, never of an input
    whose bytes are the seed's; the checkpoint untouched."""
    before = tree_digest(ck)
    rc, lines = run_cli(["validate", str(ck), "--deep"], tmp)
    if tree_digest(ck) != before:
        return result("other", f"validate changed the checkpoint (exit {rc})")
    if rc == 0:
        if len(lines) != 1 or not lines[0].startswith("valid (deep)"):
            return result("other", f"validate exit 0 printing {lines[:3]}")
        why = valid_ok()
        return result("other", f"valid (deep) on changed files: {why}") if why else result("correct", "valid (deep)")
    why = cli_refusal(rc, lines, [str(ck)])
    if why:
        return result("other", f"validate: {why}")
    if identical:
        return result("other", f"validate refused a checkpoint whose every byte is the seed's: {lines[0]}")
    return result("refused", lines[0])


def forged_ok(
    ck: Path,
    seed: dict[str, Any],
    reference: Callable[[Path], tuple[str | None, dict[str, Any]]],
    convert: Callable[[dict[str, Any]], dict[str, Any]],
) -> str | None:
    """None when the files form a well-made checkpoint whose stored state the seed's fingerprint still describes (a
    forger who recomputed the checksums changed nothing a reader can see), else why not."""
    why, values = reference(ck)
    if why:
        return f"the files are not well-made ({why})"
    if not fingerprint_consistent(convert(values), convert(seed)):
        return "the stored tensors are not those the fingerprint describes"
    if reference is dcp_reference and counters(values) != counters(seed):
        return f"the stored counters {counters(values)} are not the seed's {counters(seed)}"
    return None


def data_and_claims(ck: Path, seed_digest: dict[str, str], seed_manifest: bytes) -> str | None:
    """None when every file but the manifest is the seed's and the manifest, a regular file of the checkpoint's own
    (a link's bytes live elsewhere and can change after any verdict), says the same of them."""
    if (ck / "manifest.json").is_symlink():
        return "manifest.json is a symlink"
    now = {k: v for k, v in tree_digest(ck).items() if k != "manifest.json"}
    if now != {k: v for k, v in seed_digest.items() if k != "manifest.json"}:
        return "data files changed"
    raw = regular_bytes(ck / "manifest.json")
    if raw is None:
        return "manifest.json unreadable"
    if claims(raw) != claims(seed_manifest):
        return "the manifest's claims changed"
    from pydantic import ValidationError

    from schemas.checkpoint import CheckpointManifest

    try:  # the manifest's documented schema (schemas/checkpoint.py), not the reader under test
        CheckpointManifest.model_validate_json(raw)
    except ValidationError as e:
        return f"the manifest breaks its schema ({e.errors()[0]['loc']})"
    return None


def run_resume(run: Path) -> dict[str, Any]:
    """The trainer's resume on one in-process rank: the run's model built and sharded (FSDP2), its Checkpointer's
    ``load_latest`` into it. Returns the live state after the load, or the refusal, and the warnings logged."""
    import logging

    from ckpt.commit.layout import RunDir
    from schemas.errors import ShardkeeperError
    from tests.harness import free_port
    from trainer.builtin.loop import Trainer
    from trainer.dist import init_distributed

    said: list[tuple[str, bool]] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((record.getMessage(), record.exc_info is not None))

    logging.getLogger().addHandler(Said(level=logging.WARNING))
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        SHARDKEEPER_DEVICE="cpu",
    )
    env = init_distributed()
    tr = Trainer(RunDir.at(run), 100, 1, env)
    try:
        ts = tr.ckpt.load_latest()
    except ShardkeeperError as e:
        return {"kind": "refused", "message": str(e), "said": said}
    if ts is None:
        return {"kind": "none", "said": said}
    state: dict[str, Any] = {}
    for n, p in tr.model.named_parameters():
        state[f"model.{n}"] = _full(p)
        for k, v in tr.optimizer.state.get(p, {}).items():
            if k in ("exp_avg", "exp_avg_sq"):
                state[f"optim.state.{n}.{k}"] = _full(v)
    return {"kind": "loaded", "counters": (ts.step, ts.tokens, ts.samples), "state": state, "said": said}


def _full(t: Any) -> Any:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _said_problem(said: list[tuple[str, bool]]) -> str | None:
    for message, traced in said:
        if traced or "\n" in message.strip() or "Traceback" in message:
            return f"a warning of more than one line: {message[:300]!r}"
    return None


def _file_multiset(run: Path) -> list[str]:
    """The bytes of every file under the run's checkpoints (whatever their directory is called now)."""
    d = run / "checkpoints"
    return sorted(f"{k.split('/', 1)[-1]}={v}" for k, v in tree_digest(d).items() if v != "dir") if d.is_dir() else []


def judge_resume(run: Path, *, identical: bool, forged: bool, ck: Path) -> dict[str, str]:
    """A resume of a run holding one (mutated) checkpoint: the live state is the seed's or exactly what the files
    say, or the load is refused in one line; nothing committed, no byte changed (a refused checkpoint may be moved
    aside, as the trainer does)."""
    before, names = _file_multiset(run), [p.name for p in _committed(run)]
    res = run_resume(run)
    if _file_multiset(run) != before or not {p.name for p in _committed(run)} <= set(names):
        return result("other", f"the resume ({res['kind']}) wrote into the run's checkpoints")
    problem = _said_problem(res["said"])
    if problem:
        return result("other", problem)
    s = seeds()
    if res["kind"] == "refused":
        message = res["message"]
        if "\n" in message.strip():
            return result("other", f"a refusal of more than one line: {message[:300]!r}")
        if identical:
            return result("other", f"the resume refused a checkpoint whose every byte is the seed's: {message}")
        return result("refused", message)
    if res["kind"] == "none":
        return result("other", "the resume found nothing to load and started from step 0")
    if matches(res["state"], state_keys(s.dcp)) is None and res["counters"] == counters(s.dcp):
        return result("correct", "loaded the seed's state")
    if forged:
        why, values = dcp_reference(ck)
        if not why and matches(res["state"], state_keys(values)) is None and res["counters"] == counters(values):
            return result("correct", "loaded exactly what the forged files say")
    return result(
        "other",
        f"loaded a state that is not the seed's ({matches(res['state'], state_keys(s.dcp))}, "
        f"counters {res['counters']})",
    )


# ----------------------------------------------------------------------------------------------- targets
def _dcp_validate_or_resume(program: dict, tmp: Path, mutate: Callable[[Path, list], None], entry: str) -> dict:
    run = fc.dcp_run_copy(tmp / "dcp")
    ck = fc.dcp_ckpt(run)
    seed_digest, seed_manifest = tree_digest(ck), (ck / "manifest.json").read_bytes()
    mutate(ck, program["ops"])
    forged = bool(program.get("forged")) and mutate is mutate_metadata
    if forged:
        rehash(ck)
    identical = tree_digest(ck) == seed_digest
    s = seeds()
    if entry == "resume":
        return judge_resume(run, identical=identical, forged=forged, ck=ck)

    def valid_ok() -> str | None:
        why = data_and_claims(ck, seed_digest, seed_manifest)
        if why and forged:
            return forged_ok(ck, s.dcp, dcp_reference, state_keys)
        return why

    return judge_validate(ck, tmp, identical=identical, valid_ok=valid_ok)


def metadata_import(program: dict, tmp: Path) -> dict:
    src = fc.plain_dcp_copy(tmp / "src")
    mutate_metadata(src, program["ops"])
    return judge_import(src, tmp, "dcp", intact=tree_digest(src) == seeds().plain_digest)


def _trainer_input(program: dict, tmp: Path, mutate: Callable[[Path, list, Path], None]) -> dict:
    src = fc.trainer_copy(tmp / "trainer")
    mutate(src, program["ops"], tmp / "outside")
    return judge_import(src, tmp, "ds", intact=tree_digest(src) == seeds().trainer_digest)


def deepspeed_import(program: dict, tmp: Path) -> dict:
    return _trainer_input(program, tmp, lambda src, ops, _: mutate_deepspeed(src / f"global_step{fc.DS_STEP}", ops))


def deepspeed_validate(program: dict, tmp: Path) -> dict:
    ck = fc.ds_ckpt_copy(tmp / "ds")
    seed_digest, seed_manifest = tree_digest(ck), (ck / "manifest.json").read_bytes()
    mutate_deepspeed(ck, program["ops"])
    forged = bool(program.get("forged"))
    if forged:
        rehash(ck)

    def valid_ok() -> str | None:
        why = data_and_claims(ck, seed_digest, seed_manifest)
        if why and forged:
            return forged_ok(ck, seeds().ds, ds_reference, from_ds)
        return why

    return judge_validate(ck, tmp, identical=tree_digest(ck) == seed_digest, valid_ok=valid_ok)


def _memory_input(program: dict, tmp: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """The crashed memory-tier run, mutated; returns (run, memory dir, the snapshot's dir now, facts)."""
    run, shm = fc.memory_copy(tmp / "mem")
    snap = shm / "checkpoints" / fc.step_name(fc.SNAP_STEP)
    facts = {
        "digest": tree_digest(snap),
        "manifest": (snap / "manifest.json").read_bytes(),
        "owner": ownership(run, shm),
        "run_id": snapshot_run_id(snap),
    }
    mutate_memory(run, shm, program["ops"], tmp / "outside")
    moved = [op[1] for op in program["ops"] if op[0] == "rename"]
    now = shm / "checkpoints" / moved[0] if moved else snap
    facts["forged"] = any(op[0] == "metadata" and op[2] for op in program["ops"])
    facts["owner_same"] = ownership(run, shm) == facts["owner"] and snapshot_run_id(now) in (facts["run_id"], None)
    facts["intact"] = not moved and tree_digest(snap) == facts["digest"]
    facts["usable"] = (
        facts["owner_same"] and not moved and data_and_claims(snap, facts["digest"], facts["manifest"]) is None
    )
    return run, shm, now, facts


def _snapshot_ok(snap: Path, facts: dict[str, Any]) -> str | None:
    """None when a snapshot may be taken for valid: intact, or forged into a checkpoint its fingerprint describes."""
    why = data_and_claims(snap, facts["digest"], facts["manifest"])
    if why and facts["forged"]:
        return forged_ok(snap, seeds().snap, dcp_reference, state_keys)
    return why


def memory_validate(program: dict, tmp: Path) -> dict:
    _, _, snap, facts = _memory_input(program, tmp)
    if not snap.is_dir():
        return result("refused", "the snapshot's directory is gone")

    def valid_ok() -> str | None:  # a directory name carrying no step says nothing validation could contradict
        from ckpt.commit.layout import parse_step

        named = parse_step(snap.name.split(".", 1)[0])
        if named not in (None, fc.SNAP_STEP) or snap.name.endswith(".partial"):
            return f"renamed {snap.name}"
        return _snapshot_ok(snap, facts)

    return judge_validate(snap, tmp, identical=facts["intact"], valid_ok=valid_ok)


def memory_resume(program: dict, tmp: Path) -> dict:
    """The resume of the crashed run with its memory tier: the snapshot of step 3 when it is this run's and whole
    (or forged consistently), else storage's step 2; exactly their state either way."""
    run, _, snap, facts = _memory_input(program, tmp)
    before = [p.name for p in _committed(run)]
    res = run_resume(run)
    if [p.name for p in _committed(run)] != before:
        return result("other", f"the resume ({res['kind']}) changed storage's checkpoints")
    problem = _said_problem(res["said"])
    if problem:
        return result("other", problem)
    s = seeds()
    if res["kind"] == "refused":
        if facts["owner_same"]:
            return result("other", f"the resume refused although storage's step 2 is whole: {res['message']}")
        return result("refused", res["message"])
    if res["kind"] == "none":
        return result("other", "the resume found nothing to load and started from step 0")
    step = res["counters"][0]
    if step == fc.SNAP_STEP:
        if not facts["owner_same"]:
            return result("other", "loaded a snapshot whose run identity changed")
        if matches(res["state"], state_keys(s.snap)) is None and res["counters"] == counters(s.snap):
            return result("correct", "loaded the snapshot's state")
        if facts["forged"]:
            why, values = dcp_reference(snap)
            if not why and matches(res["state"], state_keys(values)) is None and res["counters"] == counters(values):
                return result("correct", "loaded exactly what the forged snapshot says")
        why = matches(res["state"], state_keys(s.snap))
        return result("other", f"loaded a snapshot state that is not the seed's ({why})")
    if step == fc.MEMORY_STORED_STEP:
        if facts["usable"]:
            return result("other", "lost progress: the whole snapshot of step 3 was not loaded")
        if matches(res["state"], state_keys(s.stored)) is None and res["counters"] == counters(s.stored):
            return result("refused", "the snapshot was not used; storage's step 2 loaded exactly")
        return result("other", f"loaded storage's step 2 wrongly ({matches(res['state'], state_keys(s.stored))})")
    return result("other", f"loaded step {step}")


def memory_persist(program: dict, tmp: Path) -> dict:
    """The launcher's persist after the crash (``ckpt.memtier.persist.persist_newer``): a faithful copy of this
    run's whole snapshot into storage, or nothing committed and one line per thing not done."""
    from ckpt.commit.fsutil import load_yaml
    from ckpt.commit.layout import RunDir
    from ckpt.memtier.persist import persist_newer
    from schemas import RunSpec
    from schemas.errors import ShardkeeperError

    run, _, snap, facts = _memory_input(program, tmp)
    spec = RunSpec.model_validate(load_yaml((run / "run.yaml").read_text()))
    snap_now = tree_digest(snap) if snap.is_dir() else {}
    try:
        final, lines = persist_newer(spec, RunDir.at(run))
    except ShardkeeperError as e:  # the launcher prints it as its one line (the CLI's error line), exit 2
        final, lines = None, [str(e)]
    if any("\n" in ln.strip() for ln in lines):
        return result("other", f"a persist line of more than one line: {lines}")
    left = [p.name for p in (run / "checkpoints").iterdir() if ".partial" in p.name]
    if left:
        return result("other", f"left {left} in storage")
    stored = [p.name for p in _committed(run)]
    if final is None:
        if stored != [fc.step_name(fc.MEMORY_STORED_STEP)]:
            return result("other", f"persisted nothing but storage holds {stored}")
        if facts["usable"]:
            return result("other", f"lost progress: this run's whole snapshot was not persisted ({lines})")
        return result("refused", lines[0] if lines else "nothing persisted")
    if not facts["owner_same"]:
        return result("other", f"persisted a snapshot whose run identity changed: {final}")
    if tree_digest(final) != snap_now:
        return result("other", "the persisted checkpoint's bytes are not the snapshot's")
    why = f"renamed {snap.name}" if snap.name != fc.step_name(fc.SNAP_STEP) else _snapshot_ok(snap, facts)
    if why:
        return result("other", f"persisted a changed snapshot: {why}")
    return result("correct", f"persisted {final.name}, the snapshot's bytes")


@dataclass(frozen=True)
class Target:
    """One kind of input: its mutations and the entry points each mutated input goes through."""

    name: str
    title: str
    strategy: Any
    entries: dict[str, Callable[[dict, Path], dict]]


def _program(op: Any, forged: bool = True) -> Any:
    ops = st.lists(op, min_size=1, max_size=3)
    if not forged:
        return st.fixed_dictionaries({"ops": ops})
    return st.fixed_dictionaries({"ops": ops, "forged": st.sampled_from([True, True, True, False])})


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target(
            "metadata",
            "DCP `.metadata`",
            _program(metadata_op),
            {
                "import": metadata_import,
                "validate": lambda p, t: _dcp_validate_or_resume(p, t, mutate_metadata, "validate"),
                "resume": lambda p, t: _dcp_validate_or_resume(p, t, mutate_metadata, "resume"),
            },
        ),
        Target(
            "manifest",
            "manifest.json",
            _program(manifest_op, forged=False),
            {
                "validate": lambda p, t: _dcp_validate_or_resume(p, t, mutate_manifest, "validate"),
                "resume": lambda p, t: _dcp_validate_or_resume(p, t, mutate_manifest, "resume"),
            },
        ),
        Target(
            "deepspeed",
            "DeepSpeed model/optim states",
            _program(deepspeed_op),
            {"import": deepspeed_import, "validate": deepspeed_validate},
        ),
        Target(
            "latest",
            "DeepSpeed `latest`",
            _program(latest_op, forged=False),
            {"import": lambda p, t: _trainer_input(p, t, mutate_latest)},
        ),
        Target(
            "layout",
            "`checkpoint-N/` layout",
            _program(layout_op, forged=False),
            {"import": lambda p, t: _trainer_input(p, t, mutate_layout)},
        ),
        Target(
            "memory",
            "memory snapshot",
            _program(memory_op, forged=False),
            {"resume": memory_resume, "validate": memory_validate, "persist": memory_persist},
        ),
    ]
}


# ----------------------------------------------------------------------------------------------- the worker
def execute(job: dict, tmp: Path) -> dict[str, str]:
    """One entry point on one mutated input (in the forked process); any exception is an ``other`` outcome."""
    try:
        return TARGETS[job["target"]].entries[job["entry"]](job["program"], tmp)
    except BaseException as e:
        tb = traceback.format_exception(e)
        return result("other", f"{type(e).__name__}: {str(e)[:200]} at {' | '.join(x.strip() for x in tb[-3:])}")


def _vm_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _run_forked(job: dict, base: Path, deadline_s: float, rss_bound: int) -> dict[str, Any]:
    """Fork; the child runs ``execute`` with its output to a file and an address-space limit; the parent kills it at
    the deadline and reads its peak resident memory from ``wait4``."""
    tmp = Path(tempfile.mkdtemp(prefix="in-", dir=base))
    out = tmp / "result.json"
    rss_base = _vm_bytes("VmRSS")
    limit = _vm_bytes("VmSize") + ADDRESS_SPACE_MARGIN
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the input's own process: nothing it does reaches the worker
        code = 0
        try:
            (tmp / "rss0").write_text(str(_vm_bytes("VmRSS")))  # what the fork left resident (shared pages fault in)
            fd = os.open(tmp / "output.txt", os.O_WRONLY | os.O_CREAT, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            out.write_text(json.dumps(execute(job, tmp)))
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    killed = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > deadline_s and not killed:
            os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.005)
    seconds = time.monotonic() - t0
    peak = usage.ru_maxrss * 1024
    if killed:
        res = result("other", f"still running after the {deadline_s:.0f} s deadline: killed")
    elif out.is_file():
        res = json.loads(out.read_text())
    else:
        tail = (tmp / "output.txt").read_text(errors="replace")[-400:] if (tmp / "output.txt").exists() else ""
        res = result("other", f"the input's process died ({_status(status)}): {tail}")
    try:
        start = int((tmp / "rss0").read_text())
    except (OSError, ValueError):
        start = 0
    if peak > rss_base + rss_bound and res["outcome"] != "other":
        res = result(
            "other",
            f"peak RSS {peak / MiB:.0f} MiB, over the worker's {rss_base / MiB:.0f} MiB + {rss_bound / MiB:.0f} MiB",
        )
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        **job,
        **res,
        "seconds": round(seconds, 3),
        "rss_mib": round(peak / MiB, 1),
        "rss_added_mib": round(max(0, peak - start) / MiB, 1),
    }


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def serve() -> None:
    """The worker: import what every entry point needs once, read the seeds, then fork one process per input read
    from stdin (one JSON job a line), answering one JSON result a line. Its own stdout is kept for the answers."""
    import importlib

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the product prints at import goes to stderr
    import torch

    torch.set_num_threads(1)  # no thread pool in the worker: forking it is safe
    for name in _PRELOAD:  # imported once here, not again in every input's process
        importlib.import_module(name)
    seeds()
    shm = Path("/dev/shm")  # a tmpfs where there is one: the entry points' fsyncs cost nothing there
    base = Path(tempfile.mkdtemp(prefix="fuzz-worker-", dir=shm if os.access(shm, os.W_OK) else None))
    answers.write(json.dumps({"ready": True, "rss_mib": round(_vm_bytes("VmRSS") / MiB, 1)}) + "\n")
    try:
        for line in sys.stdin:
            job = json.loads(line)
            answers.write(json.dumps(_run_forked(job, base, job.pop("deadline_s"), job.pop("rss_bound"))) + "\n")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    answers.flush()
    os._exit(0)  # nothing left to flush: not seconds of interpreter shutdown with torch loaded


# what the entry points import, some of it lazily: the worker imports it once before it forks
_PRELOAD = (
    "ckpt.formats.deepspeed.convert",
    "ckpt.formats.foreign.readers",
    "ckpt.formats.foreign.commit",
    "ckpt.memtier.persist",
    "ckpt.pretrained",
    "deepspeed.runtime.fp16.loss_scaler",
    "deepspeed.runtime.zero.config",
    "deepspeed.utils.tensor_fragment",
    "launch.base",
    "rich._emoji_codes",
    "schemas.requests",
    "shardkeeper.cli",
    "shardkeeper.config",
    "shardkeeper.importing",
    "shardkeeper.preflight",
    "shardkeeper.stages",
    "tests.harness",
    "trainer.deepspeed.shm",
    "trainer.builtin.loop",
    "transformers.models.llama.modeling_llama",
)


class Fuzzer:
    """The warm worker, from the test's or the bench's side: ``run(target, program)`` sends one mutated input through
    every entry point of its target, each in its own process, and returns one result per entry point (outcome, why,
    seconds, peak RSS)."""

    def __init__(self, *, deadline_s: float = 60.0, rss_bound: int = RSS_BOUND, log: Path | None = None):
        self.deadline_s, self.rss_bound = deadline_s, rss_bound
        self.log = open(log or os.devnull, "ab")
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {
            **os.environ,
            "PYTHONPATH": path,
            "OMP_NUM_THREADS": "1",
            "SHARDKEEPER_DEVICE": "cpu",
            "DS_ACCELERATOR": "cpu",
            "COLUMNS": "200",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PYTHONWARNINGS": "ignore",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.fuzz_lib", "--serve"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )
        ready = self._read(600)
        self.worker_rss_mib = ready["rss_mib"]
        self.results: list[dict[str, Any]] = []

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError("the fuzz worker did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fuzz worker exited ({self.proc.poll()})")
        return json.loads(line)

    def run(self, target: str, program: dict) -> list[dict[str, Any]]:
        out = []
        assert self.proc.stdin is not None
        for entry in TARGETS[target].entries:
            job = {
                "target": target,
                "entry": entry,
                "program": program,
                "deadline_s": self.deadline_s,
                "rss_bound": self.rss_bound,
            }
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            out.append(self._read(self.deadline_s + 120))
        self.results += out
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
