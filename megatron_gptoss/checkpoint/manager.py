"""Atomic training checkpoints: a directory per step, a manifest with checksums, a `latest` pointer.

    root/
      step_000010/            a complete checkpoint: files + manifest.json (step, config, layout, sha256s)
      step_000020/
      .step_000030.partial/   being written (ignored; removed by the next save)
      latest                  the name of the newest complete checkpoint, replaced atomically

A save writes into a partial directory, fsyncs every file and the directory, renames it into place,
then replaces `latest` (write, fsync, rename). A crash at any point leaves the previous checkpoint and
pointer intact; a save that fails (a full disk, a directory it may not write) removes its partial
directory and raises CheckpointSaveError saying why and where. `find_resumable` verifies checksums and
falls back past incomplete or corrupted checkpoints, naming each one it skips; when checkpoints exist but
none is usable it raises CorruptCheckpointError naming each one and why.

Pruning keeps the newest `keep_last` *verified* checkpoints: one this manager wrote, or one whose
checksums were checked since it was built (`find_resumable`, `mark_verified`). Only checkpoints older
than the oldest of those are deleted, so the newest verified checkpoint is never deleted and an
unverified (possibly corrupt) newer one never pushes a good one out. With a `run_id` every manifest
records it, and a checkpoint of another run is neither resumed nor pruned.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import resource
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from megatron_gptoss.errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from megatron_gptoss.utils.files import fsync_path

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
LATEST = "latest"
FIELDS = "fields"  # the manifest's list of its own top-level keys


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


_OS_ERRORS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
}
WRITE_ERRNOS = frozenset(_OS_ERRORS)


def describe_os_error(err: OSError, path: str | os.PathLike | None = None) -> str:
    """`err` in words a user acts on: "disk full writing <file>: [Errno 28] ...", "permission denied
    writing <file>: ...", "file size limit exceeded (ulimit -f: N bytes) writing <file>: ...", naming the
    file the error carries (else `path`)."""
    what = _OS_ERRORS.get(err.errno or 0, "cannot write")
    if err.errno == errno.EFBIG:
        what += f" ({file_size_limit()})"
    where = err.filename if err.filename is not None else path
    return f"{what} writing {where}: {err}" if where is not None else f"{what}: {err}"


def file_size_limit() -> str:
    """This process's file size limit (RLIMIT_FSIZE, `ulimit -f`) in words."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return "ulimit -f: unlimited" if soft == resource.RLIM_INFINITY else f"ulimit -f: {soft} bytes"


# Free space below which a failed write is put down to a full disk.
LOW_SPACE_BYTES = 1 << 30


def write_limits(path: str | os.PathLike) -> str:
    """What bounds a write under `path`, in words, the likely cause of a failed write first: this
    process's file size limit when it has one, a file system with less than LOW_SPACE_BYTES free (a
    library that writes through its own buffers may report either as a bare RuntimeError)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError as err:
        return f"free space of {where} unknown ({err}); {file_size_limit()}"
    amount = f"{free / 2**30:.3g} GiB" if free >= 2**30 else f"{free / 2**20:.3g} MiB"
    space = f"{amount} free on the file system of {where}"
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return f"likely cause: the file size limit of this process ({file_size_limit()}); {space}"
    if free < LOW_SPACE_BYTES:
        return f"likely cause: disk full ({space})"
    return f"{space}; {file_size_limit()}"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory `path`; CorruptCheckpointError naming the file when it is
    absent (an incomplete checkpoint), truncated, not a manifest, or lacks a field its `fields` list (the
    top-level keys it was written with) names."""
    file = path / MANIFEST
    if not file.is_file():
        raise CorruptCheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CorruptCheckpointError(f"{file}: unreadable, truncated or not JSON ({err})") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"{file}: not a checkpoint manifest (no 'files' table)")
    missing = [name for name in manifest.get(FIELDS, []) if name not in manifest]
    if missing:
        raise CorruptCheckpointError(f"{file}: lacks the field(s) {missing} it was written with (edited?)")
    return manifest


def unusable(root: Path, problems: list[tuple[str, str]]) -> CorruptCheckpointError:
    """The error of a resume that found checkpoints under `root` but none it can use: each one named
    with why (`problems`: name, reason)."""
    lines = "".join(f"\n  {name}: {why}" for name, why in problems)
    return CorruptCheckpointError(
        f"{root} holds {len(problems)} checkpoint(s) and none can be resumed:{lines}\n"
        "Resume one by its path, or start a new run (without resume) that overwrites them."
    )


class CheckpointManager:
    """Step directories under `root`, the newest `keep_last` verified ones kept; `run_id` (when given)
    goes into every manifest and limits resume and pruning to this run's checkpoints."""

    def __init__(self, root: str | Path, keep_last: int = 3, run_id: str | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.run_id = run_id
        self._verified: set[str] = set()  # names of step directories known to match their checksums

    # --------------------------------------------------------------------------------------------
    def save(self, step: int, write_files: Callable[[Path], None], metadata: dict[str, Any]) -> Path:
        """`write_files(directory)` writes the checkpoint's files; then the manifest, fsync, rename,
        pointer. Returns the final directory. Never touches an existing complete checkpoint of `step`
        until the new one is complete."""
        partial = self.begin(step)
        try:
            write_files(partial)
        except OSError as err:
            shutil.rmtree(partial, ignore_errors=True)
            raise self.save_error(step, err, partial) from err
        return self.commit(step, partial, metadata)

    def save_error(self, step: int, err: OSError, path: Path) -> CheckpointSaveError:
        """The CheckpointSaveError of a save of `step` that failed with `err` while writing `path`."""
        return CheckpointSaveError(
            f"checkpoint of step {step} not saved ({describe_os_error(err, path)}); its partial files were "
            f"removed, earlier checkpoints in {self.root} and 'latest' are untouched"
        )

    def begin(self, step: int) -> Path:
        """The empty partial directory a save of `step` writes into (debris of an earlier save removed).
        A save by several processes: one calls `begin`, all write, then that one calls `commit`.
        Raises CheckpointSaveError when the directory cannot be made (permissions, a full disk)."""
        partial = self.root / f".{step_dir_name(step)}.partial"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as err:
            raise self.save_error(step, err, partial) from err
        return partial

    def commit(
        self, step: int, partial: Path, metadata: dict[str, Any], checksums: dict[str, str] | None = None
    ) -> Path:
        """Finish a save begun by `begin`: manifest (with `checksums`, relative path -> sha256, when the
        writers computed them; they must name exactly the files present), fsync, rename, pointer, prune.
        Returns the final directory. A write that fails removes `partial` and raises CheckpointSaveError;
        the checkpoints already complete and `latest` stay as they were."""
        final = self.root / step_dir_name(step)
        if self.run_id is not None:
            metadata = {**metadata, "run_id": self.run_id}
        try:
            write_manifest(partial, step, metadata, checksums)
        except OSError as err:
            shutil.rmtree(partial, ignore_errors=True)
            raise self.save_error(step, err, partial / MANIFEST) from err
        if final.exists():  # a re-save of the same step: move the old one aside only now
            trash = self.root / f".{final.name}.old"
            if trash.exists():
                shutil.rmtree(trash)
            final.rename(trash)
            partial.rename(final)
            shutil.rmtree(trash)
        else:
            partial.rename(final)
        self._verified.add(final.name)  # the writers hashed the files they wrote
        try:
            fsync_path(self.root)
            self._point_latest(final.name)
        except OSError as err:
            raise CheckpointSaveError(
                f"checkpoint {final} is complete but 'latest' was not updated "
                f"({describe_os_error(err, self.root / LATEST)}); resume auto still finds it"
            ) from err
        self._prune()
        return final

    def mark_verified(self, path: Path) -> None:
        """Record that checkpoint `path` (under `root`) matched every checksum of its manifest."""
        self._verified.add(Path(path).name)

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        fsync_path(tmp)
        tmp.replace(self.root / LATEST)
        fsync_path(self.root)

    def _prune(self) -> None:
        """Delete the checkpoints older than the newest `keep_last` verified ones of this run; never one of
        another run, never an unverified one newer than those (module docstring)."""
        kept = 0
        for path in reversed(self.complete_checkpoints()):
            if self._foreign(path) is not None:
                continue
            if kept < self.keep_last:
                kept += path.name in self._verified
                continue
            log.info("pruning checkpoint %s (%d newer verified ones kept)", path, self.keep_last)
            shutil.rmtree(path, ignore_errors=True)
            self._verified.discard(path.name)

    def _foreign(self, path: Path) -> str | None:
        """The run id of checkpoint `path` when it belongs to another run than this manager's (None: this
        run's, a manifest without run id, no run id here, or an unreadable manifest)."""
        if self.run_id is None:
            return None
        try:
            other = read_manifest(path).get("run_id")
        except CorruptCheckpointError:
            return None
        return other if other is not None and other != self.run_id else None

    def check_run(self, manifest: dict[str, Any], path: Path) -> None:
        """CheckpointError when the checkpoint `path` (its `manifest`) was written by another run."""
        other = manifest.get("run_id")
        if self.run_id is not None and other is not None and other != self.run_id:
            raise CheckpointError(f"{path}: written by run {other}, not by this run ({self.run_id})")

    # --------------------------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        """Step directories that have a manifest, oldest first (contents not verified)."""
        if not self.root.exists():
            return []
        dirs = [p for p in self.root.glob("step_*") if p.is_dir() and (p / MANIFEST).exists()]
        return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))

    @staticmethod
    def verify(path: Path, files: Iterable[str] | None = None) -> dict[str, Any]:
        """The manifest of `path` after checking the checksum of every file it lists (or of `files`, a
        subset of them); raises CorruptCheckpointError naming the first bad file."""
        manifest = read_manifest(path)
        for name in manifest["files"] if files is None else files:
            file = path / name
            if name not in manifest["files"]:
                raise CorruptCheckpointError(f"{file}: not listed in {MANIFEST}")
            if not file.exists():
                raise CorruptCheckpointError(f"{file}: missing")
            if file_sha256(file) != manifest["files"][name]:
                raise CorruptCheckpointError(f"{file}: checksum mismatch (corrupted)")
        return manifest

    def candidates(self) -> list[Path]:
        """Complete checkpoints to try on resume, newest first, the one `latest` names at the front;
        partial directories (a save that never finished) and step directories without a manifest are
        logged as skipped, by name."""
        candidates = list(reversed(self.complete_checkpoints()))
        pointer = self.root / LATEST
        named = self.root / pointer.read_text().strip() if pointer.exists() else None
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
        for partial in self.root.glob(".step_*.partial") if self.root.exists() else []:
            log.warning("skipping incomplete checkpoint %s", partial)
        for path in sorted(self.root.glob("step_*")) if self.root.exists() else []:
            if path.is_dir() and not (path / MANIFEST).exists():
                latest = f" ('{LATEST}' names it)" if path == named else ""
                log.warning("skipping checkpoint %s%s: no %s (incomplete or damaged)", path, latest, MANIFEST)
        return candidates

    def find_resumable(self) -> Path | None:
        """The newest checkpoint of this run that verifies, starting from `latest`; skipped ones are logged
        by name. None when there is no complete checkpoint; CorruptCheckpointError naming each one and
        why when there are some but none is usable."""
        problems: list[tuple[str, str]] = []
        for path in self.candidates():
            try:
                self.check_run(self.verify(path), path)
            except (CheckpointError, OSError) as err:
                log.warning("skipping checkpoint %s: %s", path.name, err)
                problems.append((path.name, str(err)))
                continue
            self.mark_verified(path)
            return path
        if problems:
            raise unusable(self.root, problems)
        return None


def write_manifest(
    directory: Path, step: int, metadata: dict[str, Any], checksums: dict[str, str] | None = None
) -> None:
    """Write `directory`/manifest.json (step, sha256 per file, `metadata`) and fsync every file and the
    directory. `checksums` (relative path -> sha256) must name exactly the files present; without it
    every file is hashed here."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    names = [str(p.relative_to(directory)) for p in files]
    if checksums is None:
        checksums = {name: file_sha256(p) for name, p in zip(names, files)}
    elif sorted(checksums) != names:
        raise CorruptCheckpointError(
            f"{directory}: the writers' checksums name {sorted(checksums)}, the directory holds {names}"
        )
    manifest = {"step": step, "files": dict(sorted(checksums.items())), **metadata}
    manifest[FIELDS] = sorted(manifest)  # `read_manifest` finds a field removed afterwards
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, directory / MANIFEST]:
        fsync_path(p)
    fsync_path(directory)
