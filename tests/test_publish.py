"""Publish stage (ckpt.publish).

- Hub: a recorded fake HfApi at the Python boundary with an in-memory repo model (commits, branches,
  tags, LFS sha256 / git blob ids), so idempotency is checked against what "the Hub" holds.
- Unreachable Hub: a real HfApi pointed at a closed loopback port.
- Live Hub: opt-in (`-m live_hub`, needs HF_TOKEN and network), skipped otherwise.
- S3: a real `moto_server` on loopback, driven through s3fs; file:// and memory:// directly.

    /work/venv/bin/pytest tests/test_publish.py -q
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckpt import publish as pub
from ckpt.publish import _hub as pub_hub
from schemas import LineageEvent
from schemas.errors import PublishError
from tests.harness import stop_process

TOKEN = "hf_TESTtokenDoNotLeak0123456789abcdef"
Bucket = tuple[Any, str, dict[str, Any]]  # boto3 client, bucket name, storage_options for s3fs


# --------------------------------------------------------------------------------------------------
# Fake export folders
# --------------------------------------------------------------------------------------------------


def _safetensors(tensors: dict[str, tuple[list[int], float]]) -> bytes:
    """A valid little safetensors file (F32) without torch."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (shape, value) in tensors.items():
        count = 1
        for d in shape:
            count *= d
        blob = struct.pack(f"<{count}f", *([value] * count))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def make_export(
    root: Path,
    *,
    step: int = 100,
    shards: int = 1,
    value: float = 1.0,
    export_json: bool = True,
    checkpoint: Path | None = None,
) -> Path:
    """config.json, generation_config.json, model(-0000i-of-0000n).safetensors (+ index), README.md, export.json."""
    out = root / f"step-{step:08d}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "vocab_size": 16,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (out / "README.md").write_text("# exported by the exporter\n")
    names = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    )
    weight_map = {}
    for i, name in enumerate(names):
        tensors = {f"layers.{i}.w": ([8, 8], value + i), f"layers.{i}.b": ([8], value)}
        (out / name).write_bytes(_safetensors(tensors))
        weight_map.update({k: name for k in tensors})
    if shards > 1:
        (out / pub.INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    if export_json:
        files = {p.name: _sha(p) for p in sorted(out.iterdir()) if p.name != "export.json"}
        result = {
            "checkpoint": str(checkpoint or root / "checkpoints" / f"step-{step:08d}"),
            "out_dir": str(out),
            "dtype": "float32",
            "files": files,
            "num_shards": shards,
            "total_bytes": 0,
            "num_tensors": 2 * shards,
        }
        time.sleep(0.01)  # export.json is written after the files, as the exporter does
        (out / "export.json").write_text(json.dumps(result))
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Fake HfApi: records every call, keeps commits/branches/tags in memory
# --------------------------------------------------------------------------------------------------


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _recorded(fn: Any) -> Any:
    """Record the call exactly as made (for the signature check), then fail on demand or run it."""

    @functools.wraps(fn)
    def wrapper(self: FakeHfApi, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((fn.__name__, args, kwargs))
        if self.fail.get(fn.__name__):
            raise self.fail[fn.__name__].pop(0)
        return fn(self, *args, **kwargs)

    return wrapper


class FakeHfApi:
    endpoint = "https://fake-hub.test"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.repos: dict[str, dict[str, Any]] = {}
        self.fail: dict[str, list[BaseException]] = {}  # method -> errors to raise on the next calls
        self._n = 0

    # -- plumbing
    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _repo(self, repo_id: str) -> dict[str, Any]:
        if repo_id not in self.repos:
            raise KeyError(f"no repo {repo_id}")
        return self.repos[repo_id]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self._repo(repo_id)
        commit = repo["branches"].get(revision) or repo["tags"].get(revision) or revision
        return repo["commits"][commit]

    def _commit(self, repo_id: str, branch: str, files: dict[str, bytes]) -> str:
        self._n += 1
        cid = hashlib.sha1(f"{repo_id}:{self._n}".encode()).hexdigest()
        repo = self._repo(repo_id)
        repo["commits"][cid] = dict(files)
        repo["branches"][branch] = cid
        return cid

    # -- the HfApi surface used by ckpt.publish (signatures as in huggingface_hub 2.x)
    @_recorded
    def create_repo(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        private: bool | None = None,
        repo_type: str | None = None,
        exist_ok: bool = False,
        **kw: Any,
    ) -> str:
        if repo_id in self.repos:
            if not exist_ok:
                raise RuntimeError("409 repo exists")
        else:
            self.repos[repo_id] = {"private": private, "branches": {}, "tags": {}, "commits": {}}
            self._commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
        return f"{self.endpoint}/{repo_id}"

    @_recorded
    def list_repo_refs(self, repo_id: str, *, token: str | None = None, **kw: Any) -> SimpleNamespace:
        repo = self._repo(repo_id)

        def refs(kind: str, d: dict[str, str]) -> list[SimpleNamespace]:
            return [SimpleNamespace(name=n, ref=f"refs/{kind}/{n}", target_commit=c) for n, c in d.items()]

        return SimpleNamespace(branches=refs("heads", repo["branches"]), tags=refs("tags", repo["tags"]), converts=[])

    @_recorded
    def create_branch(
        self,
        repo_id: str,
        *,
        branch: str,
        revision: str | None = None,
        token: str | None = None,
        exist_ok: bool = False,
        **kw: Any,
    ) -> None:
        repo = self._repo(repo_id)
        if branch in repo["branches"] and not exist_ok:
            raise RuntimeError("409 branch exists")
        repo["branches"].setdefault(branch, repo["branches"][revision or "main"])

    def _repo_file(self, path: str, data: bytes) -> Any:
        from huggingface_hub.hf_api import RepoFile

        if path.endswith(".safetensors"):  # LFS-tracked, as the .gitattributes says
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            return RepoFile(
                path=path,
                size=len(data),
                oid=_git_blob(pointer.encode()),
                lfs={"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": len(pointer)},
            )
        return RepoFile(path=path, size=len(data), oid=_git_blob(data))

    @_recorded
    def list_repo_tree(
        self,
        repo_id: str,
        path_in_repo: str | None = None,
        *,
        recursive: bool = False,
        revision: str | None = None,
        token: str | None = None,
        **kw: Any,
    ) -> Iterator[Any]:
        for path, data in sorted(self.files(repo_id, revision or "main").items()):
            yield self._repo_file(path, data)

    @_recorded
    def get_paths_info(
        self, repo_id: str, paths: list[str] | str, *, revision: str | None = None, token: str | None = None, **kw: Any
    ) -> list[Any]:
        files = self.files(repo_id, revision or "main")
        return [self._repo_file(p, files[p]) for p in ([paths] if isinstance(paths, str) else paths) if p in files]

    @_recorded
    def upload_folder(
        self,
        *,
        repo_id: str,
        folder_path: str,
        path_in_repo: str | None = None,
        commit_message: str | None = None,
        token: str | None = None,
        revision: str | None = None,
        allow_patterns: list[str] | None = None,
        ignore_patterns: list[str] | None = None,
        delete_patterns: list[str] | None = None,
        **kw: Any,
    ) -> SimpleNamespace:
        from huggingface_hub.utils import filter_repo_objects

        root = Path(folder_path)
        local = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        added = {
            rel: (root / rel).read_bytes()
            for rel in filter_repo_objects(local, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        }
        files = dict(self.files(repo_id, revision or "main"))
        deleted = set(filter_repo_objects(list(files), allow_patterns=delete_patterns)) if delete_patterns else set()
        for rel in deleted - set(added) - {".gitattributes"}:
            del files[rel]
        files.update(added)
        cid = self._commit(repo_id, revision or "main", files)
        return SimpleNamespace(oid=cid, commit_url=f"{self.endpoint}/{repo_id}/commit/{cid}")

    @_recorded
    def create_commit(
        self,
        repo_id: str,
        operations: list[Any],
        *,
        commit_message: str,
        token: str | None = None,
        revision: str | None = None,
        **kw: Any,
    ) -> SimpleNamespace:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        files = dict(self.files(repo_id, revision or "main"))
        for op in operations:
            if isinstance(op, CommitOperationAdd):
                src = op.path_or_fileobj
                files[op.path_in_repo] = src if isinstance(src, bytes) else Path(src).read_bytes()
            elif isinstance(op, CommitOperationDelete):
                files.pop(op.path_in_repo, None)
        cid = self._commit(repo_id, revision or "main", files)
        return SimpleNamespace(oid=cid, commit_url=f"{self.endpoint}/{repo_id}/commit/{cid}")

    @_recorded
    def create_tag(
        self,
        repo_id: str,
        *,
        tag: str,
        revision: str | None = None,
        token: str | None = None,
        exist_ok: bool = False,
        **kw: Any,
    ) -> None:
        repo = self._repo(repo_id)
        if tag in repo["tags"]:
            if not exist_ok:
                raise RuntimeError("409 tag exists")
            return
        repo["tags"][tag] = repo["branches"].get(revision or "main", revision)

    @_recorded
    def delete_tag(self, repo_id: str, *, tag: str, token: str | None = None, **kw: Any) -> None:
        del self._repo(repo_id)["tags"][tag]

    @_recorded
    def delete_branch(self, repo_id: str, *, branch: str, token: str | None = None, **kw: Any) -> None:
        del self._repo(repo_id)["branches"][branch]

    def commit_count(self, repo_id: str) -> int:
        return len(self._repo(repo_id)["commits"])


class FakeHfApiLarge(FakeHfApi):
    """An older huggingface_hub surface that still has upload_large_folder (no token argument)."""

    @_recorded
    def upload_large_folder(
        self,
        repo_id: str,
        folder_path: str,
        *,
        repo_type: str,
        revision: str | None = None,
        private: bool | None = None,
        allow_patterns: list[str] | None = None,
        **kw: Any,
    ) -> None:
        from huggingface_hub.utils import filter_repo_objects

        root = Path(folder_path)
        local = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        files = dict(self.files(repo_id, revision or "main"))
        files.update(
            {rel: (root / rel).read_bytes() for rel in filter_repo_objects(local, allow_patterns=allow_patterns)}
        )
        self._commit(repo_id, revision or "main", files)


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """HF_TOKEN set; no login cache, no OIDC, no real endpoint from the environment."""
    import huggingface_hub.constants as hf_constants

    for var in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-home" / "token"))
    monkeypatch.setattr(pub_hub, "RETRY_BACKOFF_S", 0.01)


# --------------------------------------------------------------------------------------------------
# (a) Hub against the fake HfApi
# --------------------------------------------------------------------------------------------------


def test_publish_hub_fake_api_first_publish_uploads_data_then_card_and_marker_then_tag(
    tmp_path: Path, hub_env: None
) -> None:
    export = make_export(tmp_path, shards=2)
    api = FakeHfApi()
    res = pub.publish_to_hub(export, "org/tiny", api=api)

    # the second list_repo_tree: what landed is checked against the checksums before the marker commit
    assert api.names() == [
        "create_repo",
        "list_repo_refs",
        "list_repo_tree",
        "upload_folder",
        "list_repo_tree",
        "create_commit",
        "create_tag",
    ]
    _, _, create = api.calls[0]
    assert create["private"] is True and create["exist_ok"] is True
    upload = api.calls[3][2]
    assert sorted(upload["allow_patterns"]) == sorted(
        [
            "config.json",
            "generation_config.json",
            pub.INDEX_NAME,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
    )  # not README.md (generated), not export.json (local paths)
    assert pub.MARKER_NAME in upload["delete_patterns"]
    last_commit_paths = [op.path_in_repo for op in api.calls[5][2]["operations"]]
    assert last_commit_paths == ["README.md", pub.MARKER_NAME]  # the marker lands in the last commit

    files = api.files("org/tiny")
    assert "export.json" not in files
    marker = json.loads(files[pub.MARKER_NAME])
    assert marker["step"] == 100 and marker["dtype"] == "float32"
    for rel, entry in marker["files"].items():
        assert hashlib.sha256(files[rel]).hexdigest() == entry["sha256"] and len(files[rel]) == entry["size"]
    assert set(marker["files"]) == set(files) - {pub.MARKER_NAME, ".gitattributes"}

    card = files["README.md"].decode()
    assert card.startswith("---\n") and "library_name: transformers" in card and "- shardkeeper" in card
    assert "| model type | llama |" in card and "| layers | 2 |" in card and "| hidden size | 8 |" in card
    assert "| parameters | 144 |" in card  # 2 shards x (8*8 + 8)
    assert "| step | 100 |" in card and 'revision="step-00000100"' in card

    repo = api.repos["org/tiny"]
    assert repo["tags"] == {"step-00000100": repo["branches"]["main"]}
    assert res.skipped is False and res.revision == "main" and res.commit == repo["branches"]["main"]
    assert res.url == "https://fake-hub.test/org/tiny/tree/step-00000100" and res.files == 6


def test_publish_hub_fake_api_refuses_an_export_rewritten_before_the_upload_read_it(
    tmp_path: Path, hub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checksummed, then re-exported (other bytes) before upload_folder read the files: the marker would claim
    the old checksums for the new bytes; the publish is refused before the marker commit and no tag is made."""
    export = make_export(tmp_path)
    api = FakeHfApi()
    real = pub_hub.upload_data

    def reexport_then_upload(*args: Any, **kwargs: Any) -> None:
        make_export(tmp_path, value=9.0)  # same names and sizes, other bytes
        real(*args, **kwargs)

    monkeypatch.setattr(pub_hub, "upload_data", reexport_then_upload)
    with pytest.raises(PublishError, match="what was uploaded is not what was checksummed") as err:
        pub.publish_to_hub(export, "org/tiny", api=api)
    assert "\n" not in str(err.value)
    assert pub.MARKER_NAME not in api.files("org/tiny") and "create_tag" not in api.names()
    monkeypatch.setattr(pub_hub, "upload_data", real)
    pub.publish_to_hub(export, "org/tiny", api=api)  # the export complete again: published, marker true
    marker = json.loads(api.files("org/tiny")[pub.MARKER_NAME])
    assert marker["files"]["model.safetensors"]["sha256"] == _sha(export / "model.safetensors")


def test_publish_hub_fake_api_republish_same_bytes_is_a_noop(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path)
    api = FakeHfApi()
    first = pub.publish_to_hub(export, "org/tiny", api=api)
    api.calls.clear()
    second = pub.publish_to_hub(export, "org/tiny", api=api)

    assert second.skipped is True and second.files == 0 and second.commit == first.commit
    assert api.names() == ["create_repo", "list_repo_refs", "list_repo_tree"]  # reads only: no upload, no tag


def test_publish_hub_fake_api_without_export_json_hashes_files_itself(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path, export_json=False)
    api = FakeHfApi()
    assert pub.publish_to_hub(export, "org/tiny", api=api).skipped is False
    marker = json.loads(api.files("org/tiny")[pub.MARKER_NAME])
    assert marker["files"]["model.safetensors"]["sha256"] == _sha(export / "model.safetensors")
    assert marker["step"] == 100 and marker["checkpoint"] is None  # step from the folder name
    assert pub.publish_to_hub(export, "org/tiny", api=api).skipped is True


def test_publish_hub_fake_api_stale_export_json_checksum_is_not_trusted(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path)
    time.sleep(0.01)
    (export / "model.safetensors").write_bytes(_safetensors({"w": ([8, 8], 9.0)}))  # modified after export.json
    api = FakeHfApi()
    pub.publish_to_hub(export, "org/tiny", api=api)
    marker = json.loads(api.files("org/tiny")[pub.MARKER_NAME])
    assert marker["files"]["model.safetensors"]["sha256"] == _sha(export / "model.safetensors")


def test_publish_hub_fake_api_changed_bytes_uploads_only_what_changed_and_moves_the_tag(
    tmp_path: Path, hub_env: None
) -> None:
    export = make_export(tmp_path, shards=2)
    api = FakeHfApi()
    first = pub.publish_to_hub(export, "org/tiny", api=api)
    shard2 = export / "model-00002-of-00002.safetensors"
    shard2.write_bytes(_safetensors({"layers.1.w": ([8, 8], 5.0), "layers.1.b": ([8], 5.0)}))
    (export / "export.json").unlink()
    api.calls.clear()

    second = pub.publish_to_hub(export, "org/tiny", api=api)
    assert second.skipped is False and second.commit != first.commit
    upload = next(kw for name, _, kw in api.calls if name == "upload_folder")
    assert upload["allow_patterns"] == ["model-00002-of-00002.safetensors"]
    assert api.files("org/tiny")["model-00002-of-00002.safetensors"] == shard2.read_bytes()
    assert json.loads(api.files("org/tiny")[pub.MARKER_NAME])["files"][shard2.name]["sha256"] == _sha(shard2)
    assert "delete_tag" in api.names()
    assert api.repos["org/tiny"]["tags"]["step-00000100"] == second.commit


def test_publish_hub_fake_api_fewer_shards_removes_stale_shards(tmp_path: Path, hub_env: None) -> None:
    api = FakeHfApi()
    pub.publish_to_hub(make_export(tmp_path, shards=3), "org/tiny", api=api)
    export = make_export(tmp_path, shards=1, value=2.0)
    pub.publish_to_hub(export, "org/tiny", api=api)
    files = api.files("org/tiny")
    assert sorted(f for f in files if "safetensors" in f) == ["model.safetensors"]
    assert pub.publish_to_hub(export, "org/tiny", api=api).skipped is True


def test_publish_hub_fake_api_only_card_changed_needs_no_data_upload(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path)
    api = FakeHfApi()
    pub.publish_to_hub(export, "org/tiny", api=api)
    api.calls.clear()
    res = pub.publish_to_hub(export, "org/tiny", api=api, model_card_extra={"license": "apache-2.0"})
    assert res.skipped is False and res.files == 1
    assert "upload_folder" not in api.names() and "create_commit" in api.names()
    assert "license: apache-2.0" in api.files("org/tiny")["README.md"].decode()


def test_publish_hub_fake_api_branch_is_created_and_main_untouched(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path)
    api = FakeHfApi()
    res = pub.publish(export, "hf://org/tiny@exp", api=api)
    assert res.revision == "exp"
    assert api.names()[:4] == ["create_repo", "list_repo_refs", "create_branch", "list_repo_refs"]
    assert api.calls[2][2]["branch"] == "exp" and api.calls[2][2]["exist_ok"] is True
    assert pub.MARKER_NAME in api.files("org/tiny", "exp")
    assert set(api.files("org/tiny", "main")) == {".gitattributes"}
    assert pub.publish(export, "org/tiny", revision="exp", api=api).skipped is True


def test_publish_hub_fake_api_crash_before_marker_is_resumed(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path)
    api = FakeHfApi()
    api.fail["create_commit"] = [RuntimeError("server closed the connection mid-commit")]
    with pytest.raises(PublishError, match="create_commit for org/tiny on https://fake-hub.test failed"):
        pub.publish_to_hub(export, "org/tiny", api=api)
    assert pub.MARKER_NAME not in api.files("org/tiny")  # data there, marker absent: incomplete

    api.calls.clear()
    res = pub.publish_to_hub(export, "org/tiny", api=api)
    assert res.skipped is False and "upload_folder" not in api.names()  # the data already matches
    assert pub.MARKER_NAME in api.files("org/tiny") and "step-00000100" in api.repos["org/tiny"]["tags"]


def test_publish_hub_fake_api_token_only_in_token_kwarg_never_in_card_logs_or_result(
    tmp_path: Path, hub_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    export = make_export(tmp_path, shards=2)
    api = FakeHfApi()
    results = [pub.publish_to_hub(export, "org/tiny", api=api, lineage=[], model_card_extra={"loss": 1.5})]
    (export / "model-00001-of-00002.safetensors").write_bytes(_safetensors({"layers.0.w": ([8, 8], 7.0)}))
    results.append(pub.publish_to_hub(export, "org/tiny", api=api))

    for name, args, kwargs in api.calls:
        assert kwargs.get("token") == TOKEN, name  # every call authenticates with it ...
        others = {k: v for k, v in kwargs.items() if k != "token"}
        contents = [getattr(op, "path_or_fileobj", b"") for op in kwargs.get("operations", [])]
        assert TOKEN not in repr(args) + repr(others) + repr(contents), name  # ... and it is nowhere else
    for files in (c for r in api.repos.values() for c in r["commits"].values()):
        assert all(TOKEN.encode() not in data for data in files.values())
    assert TOKEN not in caplog.text
    assert all(TOKEN not in r.model_dump_json() for r in results)
    assert all(TOKEN.encode() not in p.read_bytes() for p in export.rglob("*") if p.is_file())


def test_publish_hub_fake_api_calls_bind_to_the_real_hfapi_signatures(tmp_path: Path, hub_env: None) -> None:
    """The fake accepts **kw; this keeps ckpt.publish honest about the installed HfApi."""
    from huggingface_hub import HfApi

    export = make_export(tmp_path, shards=2)
    api = FakeHfApi()
    pub.publish_to_hub(export, "org/tiny", api=api, revision="exp")
    (export / "model-00001-of-00002.safetensors").write_bytes(_safetensors({"layers.0.w": ([8, 8], 7.0)}))
    pub.publish_to_hub(export, "org/tiny", api=api, revision="exp")
    assert {
        "create_repo",
        "list_repo_refs",
        "create_branch",
        "list_repo_tree",
        "upload_folder",
        "create_commit",
        "create_tag",
        "delete_tag",
    } <= set(api.names())
    pub.publish_to_hub(make_export(tmp_path, step=50), "org/tiny", api=api, revision="exp")  # older: tag only
    assert {"delete_branch"} <= set(api.names())
    for name, args, kwargs in api.calls:
        inspect.signature(getattr(HfApi, name)).bind(HfApi, *args, **kwargs)  # TypeError on a wrong argument


def _step_export(root: Path, step: int, value: float) -> Path:
    """An export of step ``step`` inside a run directory whose checkpoint manifest names the run 'demo'."""
    ckpt = root / "run" / "checkpoints" / f"step-{step:08d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": step, "tokens": step * 64, "run_name": "demo"}))
    return make_export(root / "run" / "exports", step=step, value=value, shards=2, checkpoint=ckpt)


def _assert_revision_is_export(api: FakeHfApi, revision: str, export: Path) -> None:
    files = api.files("org/tiny", revision)
    expected = {p.name: p.read_bytes() for p in export.iterdir() if p.name not in ("export.json", "README.md")}
    assert {k: v for k, v in files.items() if k not in (".gitattributes", "README.md", pub.MARKER_NAME)} == expected
    marker = json.loads(files[pub.MARKER_NAME])
    assert marker["step"] == pub.load_export(export).step
    assert f'revision="step-{marker["step"]:08d}"' in files["README.md"].decode()


def test_publish_hub_fake_api_two_steps_two_tags_each_revision_is_its_export(tmp_path: Path, hub_env: None) -> None:
    first, second = _step_export(tmp_path, 100, 1.0), _step_export(tmp_path, 200, 2.0)
    api = FakeHfApi()
    r1 = pub.publish_to_hub(first, "org/tiny", api=api)
    r2 = pub.publish_to_hub(second, "org/tiny", api=api)
    repo = api.repos["org/tiny"]
    assert repo["tags"] == {"step-00000100": r1.commit, "step-00000200": r2.commit} and r1.commit != r2.commit
    assert repo["branches"] == {"main": r2.commit}  # main points at the newest step
    assert (r1.tag, r2.tag, r2.newest_step, r2.tag_only) == ("step-00000100", "step-00000200", 100, False)
    _assert_revision_is_export(api, "step-00000100", first)
    _assert_revision_is_export(api, "step-00000200", second)
    messages = [c[2]["commit_message"] for c in api.calls if c[0] in ("create_commit", "upload_folder")]
    assert messages == [
        "shardkeeper: run demo step 100: weights (float32)",
        "shardkeeper: publish run demo step 100",
        "shardkeeper: run demo step 200: weights (float32)",
        "shardkeeper: publish run demo step 200",
    ]


def test_publish_hub_fake_api_republish_of_any_step_makes_no_commit(tmp_path: Path, hub_env: None) -> None:
    first, second = _step_export(tmp_path, 100, 1.0), _step_export(tmp_path, 200, 2.0)
    api = FakeHfApi()
    pub.publish_to_hub(first, "org/tiny", api=api)
    pub.publish_to_hub(second, "org/tiny", api=api)
    commits, refs = api.commit_count("org/tiny"), json.dumps(api.repos["org/tiny"]["tags"])
    for export in (second, first, second):  # the newest (at main) and an older one (at its tag only)
        res = pub.publish_to_hub(export, "org/tiny", api=api)
        assert res.skipped is True and res.files == 0
    assert api.commit_count("org/tiny") == commits and json.dumps(api.repos["org/tiny"]["tags"]) == refs
    assert not {"create_commit", "upload_folder", "create_tag", "delete_tag", "create_branch"} & set(api.names()[-9:])


def test_publish_hub_fake_api_out_of_order_step_is_tagged_and_main_stays_on_the_newest(
    tmp_path: Path, hub_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from shardkeeper.cli import main

    older, newer = _step_export(tmp_path, 100, 1.0), _step_export(tmp_path, 200, 2.0)
    (older / "tokenizer.json").write_text('{"only": "in step 100"}')
    (newer / "chat_template.jinja").write_text("only in step 200")
    api = FakeHfApi()
    monkeypatch.setattr(pub_hub, "new_api", lambda endpoint: api)
    assert main(["publish", str(newer), "--repo-id", "org/tiny"]) == 0
    assert "(tag step-00000200)" in capsys.readouterr().out
    head = api.repos["org/tiny"]["branches"]["main"]

    assert main(["publish", str(older), "--repo-id", "org/tiny"]) == 0
    said = capsys.readouterr().out
    assert (
        "published" in said
        and "@ step-00000100" in said
        and "tag only" in said
        and "newer step 200" in said
        and "not moved back" in said
    )
    repo = api.repos["org/tiny"]
    assert repo["branches"] == {"main": head}  # main not moved back; the scratch branch is gone
    assert set(repo["tags"]) == {"step-00000100", "step-00000200"} and repo["tags"]["step-00000200"] == head
    _assert_revision_is_export(api, "step-00000100", older)  # no chat_template.jinja from step 200
    _assert_revision_is_export(api, "step-00000200", newer)
    _assert_revision_is_export(api, "main", newer)

    commits = api.commit_count("org/tiny")
    assert main(["publish", str(older), "--repo-id", "org/tiny"]) == 0
    assert "already published" in capsys.readouterr().out and api.commit_count("org/tiny") == commits


def test_publish_hub_fake_api_missing_token_is_one_line_error(
    tmp_path: Path, hub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_TOKEN")
    api = FakeHfApi()
    with pytest.raises(PublishError) as err:
        pub.publish_to_hub(make_export(tmp_path), "org/tiny", api=api)
    assert str(err.value) == "no Hugging Face token: set HF_TOKEN or run `hf auth login`"
    assert api.calls == []


def test_publish_hub_fake_api_token_from_login_cache(
    tmp_path: Path, hub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hf_constants

    monkeypatch.delenv("HF_TOKEN")
    cache = tmp_path / "hf-home" / "token"
    cache.parent.mkdir()
    cache.write_text("hf_fromLoginCache0123456789")
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(cache))
    api = FakeHfApi()
    pub.publish_to_hub(make_export(tmp_path), "org/tiny", api=api)
    assert {kw["token"] for _, _, kw in api.calls} == {"hf_fromLoginCache0123456789"}


@pytest.mark.parametrize(
    "case", ["missing", "file", "no-config", "no-weights", "index-names-missing-shard", "bad-repo-id"]
)
def test_publish_hub_fake_api_bad_export_folder_is_one_line_error(tmp_path: Path, hub_env: None, case: str) -> None:
    export = make_export(tmp_path / "x", shards=2)
    repo = "org/tiny"
    if case == "missing":
        export = tmp_path / "nope"
    elif case == "file":
        export = export / "config.json"
    elif case == "no-config":
        (export / "config.json").unlink()
    elif case == "no-weights":
        for p in export.glob("*.safetensors"):
            p.unlink()
    elif case == "index-names-missing-shard":
        (export / "model-00002-of-00002.safetensors").unlink()
    else:
        repo = "not a repo"
    api = FakeHfApi()
    with pytest.raises(PublishError) as err:
        pub.publish_to_hub(export, repo, api=api)
    message = str(err.value)
    assert "\n" not in message and len(message) < 300
    expected = {
        "missing": "does not exist",
        "file": "is a file",
        "no-config": "no config.json",
        "no-weights": "no *.safetensors",
        "index-names-missing-shard": "model-00002-of-00002.safetensors",
        "bad-repo-id": "is not a Hub repo id",
    }[case]
    assert expected in message
    assert api.calls == []


def _http_error(status: int, message: str) -> Exception:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    response = httpx2.Response(status, request=httpx2.Request("POST", "https://fake-hub.test/api/repos/create"))
    return HfHubHTTPError(f"{status} Client Error\n\nrequest id: abc", response=response, server_message=message)


def test_publish_hub_fake_api_http_errors_say_the_fix(tmp_path: Path, hub_env: None) -> None:
    export = make_export(tmp_path)
    api = FakeHfApi()
    api.fail["create_repo"] = [_http_error(403, "You don't have the rights to create a model under this namespace")]
    with pytest.raises(PublishError, match=r"no write access \(HTTP 403\); use a token with write permission on 'org'"):
        pub.publish_to_hub(export, "org/tiny", api=api)
    api.fail["create_repo"] = [_http_error(401, "Invalid credentials in Authorization header")]
    with pytest.raises(PublishError, match=r"rejected the token \(HTTP 401\)"):
        pub.publish_to_hub(export, "org/tiny", api=api)
    assert api.names() == ["create_repo", "create_repo"]  # 4xx: no retry


def test_publish_hub_fake_api_transient_errors_are_retried(tmp_path: Path, hub_env: None) -> None:
    import httpx2

    export = make_export(tmp_path)
    api = FakeHfApi()
    api.fail["create_repo"] = [httpx2.ConnectError("connection reset"), _http_error(503, "try again")]
    assert pub.publish_to_hub(export, "org/tiny", api=api).skipped is False
    assert api.names()[:3] == ["create_repo"] * 3


def test_publish_hub_fake_api_large_folder_on_older_hub_uses_upload_large_folder(
    tmp_path: Path, hub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pub_hub, "LARGE_FILES", 2)
    monkeypatch.setattr(pub_hub, "upload_folder_streams", lambda: False)
    export = make_export(tmp_path, shards=3)
    api = FakeHfApiLarge()
    pub.publish_to_hub(export, "org/tiny", api=api)
    assert "upload_large_folder" in api.names() and "upload_folder" not in api.names()
    large = next(kw for name, _, kw in api.calls if name == "upload_large_folder")
    assert large["repo_type"] == "model" and "token" not in large
    assert pub.publish_to_hub(export, "org/tiny", api=api).skipped is True

    monkeypatch.setattr(pub_hub, "upload_folder_streams", lambda: True)  # huggingface_hub >= 1.20 + hf_xet
    api2 = FakeHfApiLarge()
    pub.publish_to_hub(export, "org/tiny", api=api2)
    assert "upload_folder" in api2.names() and "upload_large_folder" not in api2.names()


def test_publish_hub_fake_api_card_has_training_summary_and_lineage_chain(tmp_path: Path, hub_env: None) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-00000100"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 100, "tokens": 204800, "run_name": "demo", "segment": 1}))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 - s / 100}) + "\n" for s in (99, 100))
    )
    export = make_export(run / "exports", checkpoint=ckpt)
    t = "2026-01-01T00:00:00Z"
    events = [
        LineageEvent(id="checkpoint:step-00000050", kind="checkpoint", time=t, step=50),
        LineageEvent(
            id="checkpoint:step-00000100", kind="checkpoint", parent="checkpoint:step-00000050", time=t, step=100
        ),
        LineageEvent(
            id="checkpoint:step-00000200", kind="checkpoint", parent="checkpoint:step-00000100", time=t, step=200
        ),
        LineageEvent(
            id="export:step-00000100:float32",
            kind="export",
            parent="checkpoint:step-00000100",
            time=t,
            step=100,
            uri=export.as_uri(),
        ),
    ]
    api = FakeHfApi()
    pub.publish_to_hub(
        export,
        "org/tiny",
        api=api,
        lineage=events,
        model_card_extra={"license": "apache-2.0", "tags": ["tiny"], "eval loss": 4.1},
    )
    card = api.files("org/tiny")["README.md"].decode()
    assert "license: apache-2.0" in card and "- tiny" in card and "- llama" in card
    assert "| tokens | 204,800 |" in card and "| loss | 4.0 |" in card and "| run | demo |" in card
    assert "| eval loss | 4.1 |" in card
    lineage = card.split("## Lineage", 1)[1]
    assert (
        lineage.index("checkpoint:step-00000050") < lineage.index("checkpoint:step-00000100") < lineage.index("export:")
    )
    assert "step-00000200" not in lineage  # not on this export's parent chain
    assert str(tmp_path) not in card  # no local paths on the Hub


# --------------------------------------------------------------------------------------------------
# (b) unreachable endpoint with a real HfApi
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_publish_hub_unreachable_endpoint_fails_fast_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    export = make_export(tmp_path)
    start = time.monotonic()
    with pytest.raises(PublishError) as err:
        pub.publish_to_hub(export, "org/tiny", endpoint=endpoint, token=TOKEN)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert elapsed < 40, elapsed
    assert f"cannot reach the Hugging Face Hub at {endpoint}" in message and "failed 3 times" in message
    assert "\n" not in message and TOKEN not in message


# --------------------------------------------------------------------------------------------------
# (c) live Hub (opt-in)
# --------------------------------------------------------------------------------------------------


def _hub_reachable() -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=3):
            return True
    except OSError:
        return False


@pytest.mark.live_hub
def test_publish_hub_live_roundtrip(tmp_path: Path) -> None:
    if not os.environ.get("HF_TOKEN"):
        pytest.skip("live Hub test: set HF_TOKEN to a token with write access")
    if not _hub_reachable():
        pytest.skip("live Hub test: huggingface.co:443 is not reachable from here")
    from huggingface_hub import HfApi

    api = HfApi()
    user = api.whoami(token=os.environ["HF_TOKEN"])["name"]
    repo_id = f"{user}/shardkeeper-live-{uuid.uuid4().hex[:8]}"
    export = make_export(tmp_path)
    try:
        first = pub.publish_to_hub(export, repo_id, private=True)
        assert first.skipped is False and first.commit
        assert pub.publish_to_hub(export, repo_id, private=True).skipped is True
        refs = api.list_repo_refs(repo_id, token=os.environ["HF_TOKEN"])
        assert "step-00000100" in {t.name for t in refs.tags}
    finally:
        api.delete_repo(repo_id, token=os.environ["HF_TOKEN"], missing_ok=True)


# --------------------------------------------------------------------------------------------------
# dispatch, file://, memory://
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("hf://org/name", ("hub", "org/name", None)),
        ("hf://org/name@exp", ("hub", "org/name", "exp")),
        ("hf://models/org/name", ("hub", "org/name", None)),
        ("org/name", ("hub", "org/name", None)),
        ("s3://bucket/prefix", ("fsspec", "s3://bucket/prefix", None)),
        ("gs://bucket/prefix", ("fsspec", "gs://bucket/prefix", None)),
        ("memory://pub", ("fsspec", "memory://pub", None)),
        ("file:///srv/models", ("fsspec", "file:///srv/models", None)),
        ("/srv/models", ("fsspec", "file:///srv/models", None)),
    ],
)
def test_publish_dispatch_parses_targets(target: str, expected: tuple[str, str, str | None]) -> None:
    assert pub.parse_target(target) == expected


@pytest.mark.parametrize("target", ["hf://datasets/org/name", "nope://x", "just-a-name", "a/b/c"])
def test_publish_dispatch_rejects_unknown_targets(target: str) -> None:
    with pytest.raises(PublishError):
        pub.parse_target(target)


def test_publish_dispatch_routes_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        pub, "publish_to_hub", lambda export_dir, repo_id, **kw: seen.update(repo_id=repo_id, **kw) or "hub"
    )
    assert pub.publish(tmp_path, "org/name", revision="b", lineage=None) == "hub"
    assert seen == {"repo_id": "org/name", "revision": "b", "lineage": None}
    with pytest.raises(PublishError, match="revision apply to Hub targets only"):
        pub.publish(tmp_path, "memory://x", revision="b")
    with pytest.raises(PublishError, match="names branch 'a' but revision='b'"):
        pub.publish(tmp_path, "hf://org/name@a", revision="b")
    with pytest.raises(TypeError):
        pub.publish(tmp_path, "org/name", nonsense=1)


def test_publish_fsspec_file_url_renames_into_place_and_is_idempotent(tmp_path: Path) -> None:
    export = make_export(tmp_path / "run", shards=2)
    target = tmp_path / "published"
    url = target.as_uri()
    res = pub.publish(export, url, lineage=[], revision=None)  # as shardkeeper.stages calls it
    dest = target / "step-00000100"
    assert res.skipped is False and res.url == dest.as_uri() and res.files == 6
    assert sorted(p.name for p in target.iterdir()) == ["step-00000100"]  # no .partial-* left behind
    marker = pub.read_publish_marker(dest.as_uri())
    assert marker is not None and marker["files"]["model-00001-of-00002.safetensors"]["sha256"] == _sha(
        export / "model-00001-of-00002.safetensors"
    )
    assert not (dest / "export.json").exists()
    assert pub.publish_to_fsspec(export, url).skipped is True

    export = make_export(tmp_path / "run", shards=1, value=3.0)  # same name, other bytes, fewer shards
    assert pub.publish_to_fsspec(export, url).skipped is False
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "README.md", pub.MARKER_NAME]
    )
    assert pub.publish_to_fsspec(export, url).skipped is True


def test_publish_fsspec_memory_url(tmp_path: Path) -> None:
    import fsspec

    export = make_export(tmp_path)
    url = f"memory://shardkeeper-test-{uuid.uuid4().hex[:6]}/models"
    assert pub.publish_to_fsspec(export, url).skipped is False
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(f"{url}/step-00000100/model.safetensors") == (export / "model.safetensors").read_bytes()
    assert pub.publish_to_fsspec(export, url).skipped is True
    fs.pipe_file(f"{url}/step-00000100/{pub.MARKER_NAME}", b"{not json")
    assert pub.read_publish_marker(f"{url}/step-00000100") is None
    assert pub.publish_to_fsspec(export, url).skipped is False
    assert pub.read_publish_marker(f"{url}/step-00000100") is not None


# --------------------------------------------------------------------------------------------------
# (d) S3 through a real moto_server on loopback
# --------------------------------------------------------------------------------------------------


def _moto_server_binary() -> str | None:
    candidate = Path(sys.executable).with_name("moto_server")
    return str(candidate) if candidate.exists() else shutil.which("moto_server")


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("s3fs", reason="s3 tests need s3fs (pip install s3fs)")
    pytest.importorskip("boto3", reason="s3 tests need boto3 (pip install boto3)")
    binary = _moto_server_binary()
    if binary is None:
        pytest.skip("s3 tests need moto[server] (pip install 'moto[server]'): moto_server not found")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    with pytest.MonkeyPatch.context() as mp:
        for var, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            mp.setenv(var, value)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"moto_server did not start on {endpoint} (exit code {proc.poll()})")
                    time.sleep(0.1)
            yield endpoint
        finally:
            stop_process(proc)


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Bucket:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"sk-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    options = {"client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}}
    return client, bucket, options


def _keys(client: Any, bucket: str) -> dict[str, int]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def test_publish_s3_moto_server_objects_marker_and_republish_skipped(tmp_path: Path, s3_bucket: Bucket) -> None:
    client, bucket, options = s3_bucket
    export = make_export(tmp_path, shards=2)
    url = f"s3://{bucket}/models/tiny"
    res = pub.publish(export, url, storage_options=options)
    assert res.skipped is False and res.url == f"s3://{bucket}/models/tiny/step-00000100"

    keys = _keys(client, bucket)
    prefix = "models/tiny/step-00000100/"
    expected = {p.name: p.stat().st_size for p in export.iterdir() if p.name != "export.json"}
    assert {k[len(prefix) :]: v for k, v in keys.items() if k != prefix + pub.MARKER_NAME} == expected
    marker = json.loads(client.get_object(Bucket=bucket, Key=prefix + pub.MARKER_NAME)["Body"].read())
    for name, entry in marker["files"].items():
        body = client.get_object(Bucket=bucket, Key=prefix + name)["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"]
    assert pub.read_publish_marker(res.url, storage_options=options) == marker

    assert pub.publish(export, url, storage_options=options).skipped is True


def test_publish_s3_moto_server_corrupt_or_missing_marker_or_data_is_republished(
    tmp_path: Path, s3_bucket: Bucket
) -> None:
    client, bucket, options = s3_bucket
    export = make_export(tmp_path)
    url = f"s3://{bucket}/m"
    folder = f"{url}/step-00000100"
    key = "m/step-00000100/" + pub.MARKER_NAME
    pub.publish_to_fsspec(export, url, storage_options=options)

    client.put_object(Bucket=bucket, Key=key, Body=b'{"format": "shardkeeper.publish/1", "fil')  # torn write
    assert pub.read_publish_marker(folder, storage_options=options) is None
    assert pub.publish_to_fsspec(export, url, storage_options=options).skipped is False
    assert pub.read_publish_marker(folder, storage_options=options) is not None

    client.delete_object(Bucket=bucket, Key=key)
    assert pub.publish_to_fsspec(export, url, storage_options=options).skipped is False

    client.delete_object(Bucket=bucket, Key="m/step-00000100/model.safetensors")  # marker says complete, data gone
    assert pub.publish_to_fsspec(export, url, storage_options=options).skipped is False
    assert "m/step-00000100/model.safetensors" in _keys(client, bucket)
    assert pub.publish_to_fsspec(export, url, storage_options=options).skipped is True


def test_publish_s3_moto_server_interrupted_upload_leaves_no_marker(
    tmp_path: Path, s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    client, bucket, options = s3_bucket
    url = f"s3://{bucket}/m"
    folder = f"{url}/step-00000100"
    pub.publish_to_fsspec(make_export(tmp_path), url, storage_options=options)
    export = make_export(tmp_path, value=4.0)  # new bytes under the same name

    fs = fsspec.filesystem("s3", **options)  # fsspec caches instances: publish_to_fsspec gets this one
    real_open = fs.open
    done: list[str] = []

    def flaky_open(path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:  # each file is uploaded through it
        if "w" in mode:
            if len(done) == 1:
                raise PermissionError("connection dropped")
            done.append(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(fs, "open", flaky_open)
    with pytest.raises(PublishError, match=f"cannot write s3://{bucket}/m/step-00000100"):
        pub.publish_to_fsspec(export, url, storage_options=options)
    assert pub.read_publish_marker(folder, storage_options=options) is None  # old marker gone first: incomplete

    monkeypatch.setattr(fs, "open", real_open)
    assert pub.publish_to_fsspec(export, url, storage_options=options).skipped is False
    assert pub.read_publish_marker(folder, storage_options=options)["files"]["model.safetensors"]["sha256"] == _sha(
        export / "model.safetensors"
    )


def test_publish_s3_moto_server_missing_bucket_is_one_line_error(tmp_path: Path, s3_bucket: Bucket) -> None:
    _, _, options = s3_bucket
    with pytest.raises(PublishError) as err:
        pub.publish_to_fsspec(make_export(tmp_path), "s3://no-such-bucket-sk/m", storage_options=options)
    assert "cannot write s3://no-such-bucket-sk/m/step-00000100" in str(err.value) and "\n" not in str(err.value)


def test_publish_load_export_dtype_from_safetensors_header_when_config_has_none(tmp_path: Path) -> None:
    export = make_export(tmp_path, export_json=False)
    config = json.loads((export / "config.json").read_text())
    del config["torch_dtype"]  # the exporter writes config.json with use_diff=True
    (export / "config.json").write_text(json.dumps(config))
    assert pub.load_export(export).dtype == "float32"


def test_publish_load_export_finds_its_checkpoint_in_the_run_layout_without_export_json(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000100"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 100, "tokens": 4096, "run_name": "demo"}))
    export = make_export(tmp_path / "run" / "exports", export_json=False)
    loaded = pub.load_export(export)
    assert loaded.checkpoint == str(ckpt.resolve()) and loaded.step == 100
    assert "| tokens | 4,096 |" in pub.model_card(loaded, "org/tiny")


def test_publish_hub_fake_api_step_tags_of_another_branch_neither_block_nor_move(tmp_path: Path, hub_env: None) -> None:
    """Step tags are repo-wide: main's newer step must not turn a new branch's publish into 'tag only' (nor fail
    it), and a step number main already tagged must not have its tag moved to another branch's commit."""
    main_100 = _step_export(tmp_path / "a", 100, 1.0)
    dev_50, dev_100 = _step_export(tmp_path / "b", 50, 2.0), _step_export(tmp_path / "b", 100, 3.0)
    api = FakeHfApi()
    r1 = pub.publish_to_hub(main_100, "org/tiny", api=api)
    r2 = pub.publish_to_hub(dev_50, "org/tiny", api=api, revision="dev")
    repo = api.repos["org/tiny"]
    assert r2.tag_only is False and repo["branches"]["dev"] == r2.commit == repo["tags"]["step-00000050"]
    assert repo["branches"]["main"] == r1.commit
    _assert_revision_is_export(api, "step-00000050", dev_50)
    commits = api.commit_count("org/tiny")
    with pytest.raises(PublishError, match=r"tag step-00000100 already names commit .*not the head of dev"):
        pub.publish_to_hub(dev_100, "org/tiny", api=api, revision="dev")
    assert repo["tags"]["step-00000100"] == r1.commit and api.commit_count("org/tiny") == commits
    _assert_revision_is_export(api, "step-00000100", main_100)


def test_publish_hub_fake_api_a_branch_named_like_a_step_tag_is_refused(tmp_path: Path, hub_env: None) -> None:
    """A branch and a tag of the same name make revision="step-00000100" ambiguous: refused, nothing committed."""
    export = _step_export(tmp_path, 100, 1.0)
    api = FakeHfApi()
    with pytest.raises(PublishError, match="branch named step-00000050"):
        pub.publish_to_hub(export, "org/tiny", api=api, revision="step-00000050")
    assert "org/tiny" not in api.repos  # refused before anything was created
    pub.publish_to_hub(_step_export(tmp_path / "first", 10, 1.0), "org/tiny", api=api)
    api.create_branch("org/tiny", branch="step-00000100", revision="main")  # a person's branch
    commits, tags = api.commit_count("org/tiny"), dict(api.repos["org/tiny"]["tags"])
    with pytest.raises(PublishError, match="branch named step-00000100"):
        pub.publish_to_hub(export, "org/tiny", api=api)
    assert api.commit_count("org/tiny") == commits and api.repos["org/tiny"]["tags"] == tags
