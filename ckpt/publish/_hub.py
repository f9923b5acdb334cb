"""Publishing to the Hugging Face Hub (huggingface_hub): idempotent uploads, retries, the card and marker
committed last, one tag per step."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from schemas import LineageEvent, PublishResult
from schemas.errors import PublishError

logger = logging.getLogger(__name__)
from ckpt.commit.layout import parse_step
from ckpt.publish._card import manifest_of, model_card
from ckpt.publish._folder import (
    CARD_NAME,
    LARGE_BYTES,
    LARGE_FILES,
    MARKER_NAME,
    NO_TOKEN_MESSAGE,
    REPO_ID_RE,
    RETRY_BACKOFF_S,
    RETRY_BUDGET_S,
    RETRY_TRIES,
    WEIGHT_PATTERNS,
    ExportFolder,
    PublishedFile,
    entry_of_bytes,
    load_export,
    marker_bytes,
)


def resolve_token(token: str | None = None) -> str:
    """The token to publish with: the one given, else HF_TOKEN, else the `hf auth login` cache."""
    if token:
        return token
    from huggingface_hub import get_token

    try:
        found = get_token()
    except Exception as err:  # e.g. an OIDC exchange that failed: say so without its details
        raise PublishError(
            f"cannot get a Hugging Face token ({type(err).__name__}): set HF_TOKEN or run `hf auth login`"
        ) from err
    if not found:
        raise PublishError(NO_TOKEN_MESSAGE)
    return found


def network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests.exceptions", ("ConnectionError", "Timeout")),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return tuple(errors)


def http_status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


class HubClient:
    """One repo on one endpoint: every call gets the token as ``token=`` and bounded retries."""

    def __init__(self, api: Any, repo_id: str, token: str) -> None:
        from huggingface_hub import constants

        self.api = api
        self.repo_id = repo_id
        self._token = token
        self.endpoint = str(getattr(api, "endpoint", None) or constants.ENDPOINT).rstrip("/")
        self._network = network_errors()

    def call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        fn: Callable[..., Any] = getattr(self.api, what)
        deadline = time.monotonic() + RETRY_BUDGET_S
        for attempt in range(1, RETRY_TRIES + 1):
            try:
                result = fn(*args, token=self._token, **kwargs)
                return list(result) if isinstance(result, Iterator) else result  # list_repo_tree pages lazily
            except Exception as err:
                wait = RETRY_BACKOFF_S * 2 ** (attempt - 1)
                if not self._transient(err) or attempt == RETRY_TRIES or time.monotonic() + wait > deadline:
                    raise PublishError(self._scrub(self._message(what, err, attempt))) from err
                logger.warning(
                    "%s on %s failed (%s); retry %d of %d in %.1f s",
                    what,
                    self.endpoint,
                    type(err).__name__,
                    attempt,
                    RETRY_TRIES - 1,
                    wait,
                )
                time.sleep(wait)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _transient(self, err: Exception) -> bool:
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(err, OfflineModeIsEnabled):
            return False
        if isinstance(err, HfHubHTTPError):
            return http_status(err) in (500, 502, 503, 504)
        return isinstance(err, self._network)

    def _message(self, what: str, err: Exception, attempts: int) -> str:
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        status = http_status(err) if isinstance(err, HfHubHTTPError) else None
        where = f"{what} for {self.repo_id} on {self.endpoint}"
        if isinstance(err, OfflineModeIsEnabled):
            return f"{where} refused: HF_HUB_OFFLINE is set; unset it to publish"
        if status == 401:
            return (
                f"{where}: the Hub rejected the token (HTTP 401); set HF_TOKEN to a valid token or run `hf auth login`"
            )
        if status == 403:
            org = self.repo_id.split("/")[0]
            return f"{where}: no write access (HTTP 403); use a token with write permission on '{org}'"
        if status is not None:
            detail = (getattr(err, "server_message", None) or str(err)).strip().splitlines()
            return f"{where} failed: HTTP {status} {detail[0] if detail else ''}".rstrip()
        if self._transient(err):
            return (
                f"cannot reach the Hugging Face Hub at {self.endpoint}: {what} failed {attempts} times "
                f"({type(err).__name__}); check the network, a proxy, or HF_ENDPOINT"
            )
        first = str(err).strip().splitlines()
        return f"{where} failed: {type(err).__name__}: {first[0] if first else ''}".rstrip(": ")

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text


@dataclass(frozen=True)
class HubState:
    head: str | None  # commit of the revision the files were listed at
    files: dict[str, Any]  # path -> RepoFile at that commit


@dataclass(frozen=True)
class HubRefs:
    branches: dict[str, str]  # branch -> commit
    tags: dict[str, str]  # tag -> commit

    @property
    def newest_step(self) -> int | None:
        """The newest step with a ``step-XXXXXXXX`` tag anywhere in the repo."""
        steps = [s for s in (parse_step(t) for t in self.tags) if s is not None]
        return max(steps) if steps else None

    def branch_step(self, branch: str) -> int | None:
        """The step ``branch`` holds: the newest step tag at its head. Tags are repo-wide, so another branch's
        steps say nothing about this one (a branch that does not exist yet holds none); a head that carries no
        step tag (a person committed on top) falls back to the repo's newest step, so it is never moved back."""
        head = self.branches.get(branch)
        if head is None:
            return None
        steps = [s for s in (parse_step(t) for t, c in self.tags.items() if c == head) if s is not None]
        return max(steps) if steps else self.newest_step


def publish_to_hub(
    export_dir: str | os.PathLike[str],
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = True,
    api: Any = None,
    endpoint: str | None = None,
    token: str | None = None,
    model_card_extra: dict[str, Any] | None = None,
    lineage: list[LineageEvent] | None = None,
) -> PublishResult:
    """Upload an export folder to ``repo_id`` on branch ``revision`` (default main) and tag it ``step-XXXXXXXX``.

    One revision per step: every step gets a tag (a tag, not a branch: a step's revision must never move,
    and ``from_pretrained(repo, revision="step-00000100")`` takes a tag like a branch), and the branch
    follows the newest step. An export OLDER than the newest tagged step is committed on a scratch branch
    (``shardkeeper-step-XXXXXXXX``, deleted afterwards), tagged, and the branch is left where it is
    (``tag_only=True``): publishing out of order never moves main backwards.

    Idempotent: when every file, the generated card and the marker are already at the branch head (or, for
    an older step, at its tag) with the same checksums, nothing is uploaded and ``skipped=True``; the
    export is byte-reproducible, so re-publishing a step makes no second commit.
    ``token`` defaults to HF_TOKEN or the `hf auth login` cache; it is passed per call, never stored.
    """
    if not REPO_ID_RE.match(repo_id):
        raise PublishError(f"'{repo_id}' is not a Hub repo id: use ORG/NAME (letters, digits, '-', '_', '.')")
    token = resolve_token(token)  # before hashing a large export: fail fast
    export = load_export(export_dir)
    hub = HubClient(api if api is not None else new_api(endpoint), repo_id, token)
    branch = revision or "main"
    card = model_card(export, repo_id, branch=branch, lineage=lineage, extra=model_card_extra).encode("utf-8")
    files = {**export.files, CARD_NAME: entry_of_bytes(card)}
    generated = {CARD_NAME: card, MARKER_NAME: marker_bytes(export, files)}

    if parse_step(branch) is not None:  # before anything is created on the Hub
        _refuse_clash(repo_id, branch)
    hub.call("create_repo", repo_id, private=private, exist_ok=True)
    refs = hub_refs(hub)
    newest = refs.branch_step(branch)
    tag = export.tag
    if tag in refs.branches:
        _refuse_clash(repo_id, tag)
    url = f"{hub.endpoint}/{repo_id}/tree/{tag or branch}"
    common = dict(target=repo_id, url=url, tag=tag, newest_step=newest)
    if export.step is not None and newest is not None and export.step < newest:
        assert tag is not None
        if tag in refs.tags and not changed_files(hub_state(hub, tag, refs.tags[tag]), export, files, generated):
            logger.info("%s is already at %s@%s with the same checksums: nothing to upload", export.root, repo_id, tag)
            return PublishResult(revision=tag, commit=refs.tags[tag], skipped=True, files=0, tag_only=True, **common)
        scratch = f"shardkeeper-{tag}"  # fixed name: a publish that crashed half-way continues on it
        scratch_refs = ensure_branch(hub, refs, scratch, branch)
        state = hub_state(hub, scratch, scratch_refs.branches.get(scratch))
        commit, n = push(hub, export, scratch, state, files, generated, exact=True, private=private)
        ensure_tag(hub, tag, commit, refs.tags)
        hub.call("delete_branch", repo_id, branch=scratch)
        logger.info(
            "published %s to %s as tag %s only: %s holds the newer step %d", export.root, repo_id, tag, branch, newest
        )
        return PublishResult(revision=tag, commit=commit, skipped=False, files=n, tag_only=True, **common)

    if tag in refs.tags and refs.tags[tag] != refs.branches.get(branch):
        # the tag names a commit that is not this branch's head: another branch's (or run's) step of that number
        raise PublishError(
            f"{repo_id}: tag {tag} already names commit {refs.tags[tag][:12]}, which is not the head of "
            f"{branch} (another branch or run published a step {export.step}); a published step's "
            "revision never moves: publish to another repo, or delete that tag on the Hub first"
        )
    state = hub_state(hub, branch, ensure_branch(hub, refs, branch, "main").branches.get(branch))
    if not changed_files(state, export, files, generated):
        logger.info("%s is already at %s@%s with the same checksums: nothing to upload", export.root, repo_id, branch)
        ensure_tag(hub, tag, state.head, refs.tags)
        return PublishResult(revision=branch, commit=state.head, skipped=True, files=0, **common)
    commit, n = push(hub, export, branch, state, files, generated, exact=False, private=private)
    ensure_tag(hub, tag, commit, refs.tags)
    logger.info("published %s to %s@%s (%d files changed, commit %s)", export.root, repo_id, branch, n, commit)
    return PublishResult(revision=branch, commit=commit, skipped=False, files=n, **common)


def _refuse_clash(repo_id: str, name: str) -> None:
    """A branch and a tag of one name make ``revision=name`` mean either."""
    raise PublishError(
        f"{repo_id}: a branch named {name} would share its name with a step tag, and "
        f'revision="{name}" would then mean either; publish to another --revision, or rename '
        "that branch on the Hub"
    )


def push(
    hub: HubClient,
    export: ExportFolder,
    branch: str,
    state: HubState,
    files: dict[str, PublishedFile],
    generated: dict[str, bytes],
    *,
    exact: bool,
    private: bool,
) -> tuple[str, int]:
    """Commit what changed on ``branch``: data files first, then card + marker. Returns (commit, files changed).

    Stale files go in the same commits: on a scratch branch (``exact``) everything the export does not hold,
    so the tagged revision is exactly that step's export; on a user's branch only weight files, so files a
    person added to the repo stay.
    """
    changed = changed_files(state, export, files, generated)
    if not changed:  # a scratch branch whose last publish committed but never got its tag
        assert state.head is not None
        return state.head, 0
    stale = sorted(
        p
        for p in state.files
        if p not in files and p != MARKER_NAME and p != ".gitattributes" and (exact or is_weight_file(p))
    )
    data = [p for p in changed if p in export.files and p != CARD_NAME]  # the card goes with the marker
    if data:
        upload_data(hub, export, branch, data, stale, private=private)
        stale = []
        verify_uploaded(hub, export, branch, data, generated)
    commit = commit_card_and_marker(hub, export, branch, generated[CARD_NAME], generated[MARKER_NAME], stale)
    return commit, len([p for p in changed if p != MARKER_NAME])


def verify_uploaded(
    hub: HubClient, export: ExportFolder, branch: str, paths: list[str], generated: dict[str, bytes]
) -> None:
    """What landed on ``branch`` is what the marker will claim (the files were checksummed before the upload read
    them: a re-export in between would publish other bytes under the old checksums). A mismatch refuses the
    publish before the marker commit, so the revision reads as incomplete."""
    landed = hub_state(hub, branch, None).files
    wrong = [p for p in paths if not same_on_hub(landed.get(p), export, p, generated)]
    if wrong:
        raise PublishError(
            f"{export.root / wrong[0]}: what was uploaded is not what was checksummed (the export "
            "folder changed while being published, a re-export?); the marker was not written, so "
            f"{hub.repo_id}@{branch} reads as incomplete: publish again once the export is complete"
        )


def changed_files(
    state: HubState, export: ExportFolder, files: dict[str, PublishedFile], generated: dict[str, bytes]
) -> list[str]:
    return [p for p in sorted([*files, MARKER_NAME]) if not same_on_hub(state.files.get(p), export, p, generated)]


def new_api(endpoint: str | None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint)  # no token here: it goes with each call


def hub_refs(hub: HubClient) -> HubRefs:
    refs = hub.call("list_repo_refs", hub.repo_id)
    return HubRefs(
        branches={b.name: b.target_commit for b in refs.branches}, tags={t.name: t.target_commit for t in refs.tags}
    )


def hub_state(hub: HubClient, revision: str, head: str | None) -> HubState:
    """The files at ``revision`` (a branch or tag), whose commit is ``head``."""
    tree = hub.call("list_repo_tree", hub.repo_id, recursive=True, revision=revision)
    files = {f.path: f for f in tree if hasattr(f, "blob_id")}  # RepoFile, not RepoFolder
    return HubState(head=head, files=files)


def ensure_branch(hub: HubClient, refs: HubRefs, branch: str, base: str) -> HubRefs:
    """Create ``branch`` from ``base`` when it is missing; the refs after that."""
    if branch in refs.branches:
        return refs
    hub.call("create_branch", hub.repo_id, branch=branch, revision=base, exist_ok=True)
    return hub_refs(hub)


def same_on_hub(remote: Any, export: ExportFolder, path: str, generated: dict[str, bytes]) -> bool:
    """True when the Hub file has our bytes: LFS sha256 when the Hub has one, else the git blob id."""
    if remote is None:
        return False
    data = generated.get(path)
    entry = entry_of_bytes(data) if data is not None else export.files[path]
    if remote.size != entry.size:
        return False
    lfs = getattr(remote, "lfs", None)
    if lfs:
        return (getattr(lfs, "sha256", None) or lfs.get("sha256")) == entry.sha256
    return remote.blob_id == git_blob_id(data if data is not None else (export.root / path).read_bytes())


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_weight_file(path: str) -> bool:
    return any(PurePosixPath(path).match(p) for p in WEIGHT_PATTERNS)


def upload_folder_streams() -> bool:
    """huggingface_hub >= 1.20 with hf_xet: upload_folder batches large folders into commits and resumes."""
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return importlib.util.find_spec("huggingface_hub._upload_pipeline") is not None and is_xet_available()


def upload_data(
    hub: HubClient, export: ExportFolder, branch: str, paths: list[str], stale: list[str], *, private: bool
) -> None:
    """Upload the changed data files; the old marker and stale shards go in the same step, before the new marker."""
    total = sum(export.files[p].size for p in paths)
    message = f"shardkeeper: {what_is_published(export)}: weights ({export.dtype or 'unknown dtype'})"
    large = total > LARGE_BYTES or len(paths) > LARGE_FILES
    if large and hasattr(hub.api, "upload_large_folder") and not upload_folder_streams():
        delete_on_hub(hub, branch, [MARKER_NAME, *stale], f"shardkeeper: {export.name} upload started")
        if not os.access(export.root, os.W_OK):
            raise PublishError(
                f"export folder {export.root} is not writable and upload_large_folder keeps its resume "
                "state in it: make it writable or upgrade huggingface_hub (>= 1.20)"
            )
        logger.info(
            "uploading %d files (%.1f GB) to %s@%s with upload_large_folder",
            len(paths),
            total / 1e9,
            hub.repo_id,
            branch,
        )
        # upload_large_folder takes no token argument: it uses the api's token or the same login cache
        hub.api.upload_large_folder(
            repo_id=hub.repo_id,
            folder_path=str(export.root),
            repo_type="model",
            revision=branch,
            private=private,
            allow_patterns=[glob.escape(p) for p in paths],
            print_report=False,
        )
        return
    logger.info("uploading %d files (%.1f MB) to %s@%s", len(paths), total / 1e6, hub.repo_id, branch)
    hub.call(
        "upload_folder",
        repo_id=hub.repo_id,
        folder_path=str(export.root),
        revision=branch,
        allow_patterns=[glob.escape(p) for p in paths],
        delete_patterns=[glob.escape(p) for p in (MARKER_NAME, *stale)],
        commit_message=message,
    )


def delete_on_hub(hub: HubClient, branch: str, paths: list[str], message: str) -> None:
    from huggingface_hub import CommitOperationDelete

    state = hub.call("get_paths_info", hub.repo_id, paths, revision=branch)
    present = [f.path for f in state if hasattr(f, "blob_id")]
    if present:
        hub.call(
            "create_commit",
            hub.repo_id,
            operations=[CommitOperationDelete(path_in_repo=p) for p in present],
            commit_message=message,
            revision=branch,
        )


def commit_card_and_marker(
    hub: HubClient, export: ExportFolder, branch: str, card: bytes, marker: bytes, stale: list[str]
) -> str:
    """The last commit of a publish: model card + marker (+ removal of stale shards not removed yet)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in stale]
    ops += [
        CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card),
        CommitOperationAdd(path_in_repo=MARKER_NAME, path_or_fileobj=marker),
    ]
    info = hub.call(
        "create_commit",
        hub.repo_id,
        operations=ops,
        revision=branch,
        commit_message=f"shardkeeper: publish {what_is_published(export)}",
    )
    return str(info.oid)


def what_is_published(export: ExportFolder) -> str:
    """'run demo step 100' (the run from the source checkpoint's manifest), for commit messages."""
    run = manifest_of(export).get("run_name")
    parts = [f"run {run}" if run else "", f"step {export.step}" if export.step is not None else export.name]
    return " ".join(p for p in parts if p)


def ensure_tag(hub: HubClient, tag: str | None, commit: str | None, tags: dict[str, str]) -> None:
    """Point ``tag`` at ``commit``: create it, or move it when the same step was re-published with other bytes."""
    if tag is None or commit is None or tags.get(tag) == commit:
        return
    if tag in tags:
        logger.warning(
            "moving tag %s of %s from %s to %s (step re-published with other bytes)",
            tag,
            hub.repo_id,
            tags[tag][:12],
            commit[:12],
        )
        hub.call("delete_tag", hub.repo_id, tag=tag)
    hub.call("create_tag", hub.repo_id, tag=tag, revision=commit, exist_ok=True)
