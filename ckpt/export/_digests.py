"""The check of model bytes that carry no CRC-32: shardkeeper's DCP saves turn torch's per-record CRC-32 off (the
manifest's xxh3-128 of each file covers every byte), so the files holding such entries are hashed whole against
the manifest, in a background thread while the copy runs, and compared before the commit."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from ckpt.commit.hashing import hash_fd
from ckpt.export._records import Entry
from schemas.checkpoint import CheckpointManifest
from schemas.errors import CheckpointError


class FileDigests:
    """xxh3-128 of every file that holds a model entry without a CRC-32, against the manifest. ``entries`` keeps
    the entries still to be CRC-checked (those with a CRC, and any whose file the manifest does not list)."""

    def __init__(
        self, ckpt_dir: Path, manifest: CheckpointManifest, entries: list[Entry], stack: ExitStack, *, verified: bool
    ):
        listed = {f.path: (f.size, f.xxh3_128) for f in manifest.files}
        self.entries: list[Entry] = []
        self._expected: dict[Path, tuple[int, str]] = {}
        fds: dict[Path, int] = {}
        for e in entries:
            name = _relative(e.path, ckpt_dir)
            if e.crc32 or name not in listed:
                self.entries.append(e)
            else:
                self._expected[e.path] = listed[name]
                fds[e.path] = e.fd
        self._jobs: dict[Path, Future[tuple[int, str]]] = {}
        if verified or not self._expected:  # ``verified``: every file was hashed against the manifest already
            self._expected = {}
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export-xxh3")  # xxhash releases the GIL
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        # through the descriptors the copy reads (not by path): a checkpoint retired once its files were opened
        # still exports whole, as without this check
        self._jobs = {p: pool.submit(hash_fd, fds[p]) for p in sorted(self._expected)}

    def finish(self) -> None:
        """Raise CheckpointError unless every such file matches its manifest entry."""
        for path, job in self._jobs.items():
            if job.result() != self._expected[path]:
                raise CheckpointError(
                    f"{path}: checksum mismatch against the manifest (xxh3-128 of the file holding "
                    "model bytes); the file is corrupted, run `shardkeeper validate --deep` and "
                    "pick another step"
                )


def _relative(path: Path, ckpt_dir: Path) -> str | None:
    try:
        return path.relative_to(ckpt_dir).as_posix()
    except ValueError:
        return None


__all__ = ["FileDigests"]
