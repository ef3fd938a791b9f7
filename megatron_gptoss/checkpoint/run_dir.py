"""A run owns its output directory: one live run at a time, and an identity its checkpoints carry.

    output_dir/
      run.lock          advisory lock (fcntl.flock) held while the run lives; holds the holder's
                        pid, host, run id and start time (JSON)
      run.json          the run's identity: run id, when and where it was created
      checkpoints/      `CheckpointManager` step directories, each manifest naming the run id

`RunDir.claim` on rank 0 takes the lock (a second live run on the same directory is refused, naming the
holder), then settles the identity:

    resume ""       a new run: a fresh run id. A directory that holds checkpoints (another run's) is
                    refused with ConfigError naming them, unless `overwrite`, which deletes them; so is
                    a directory whose run.json names another run that left no checkpoint (its metrics
                    and HF export would be replaced), unless `overwrite`.
    resume "auto"   continues the directory's run: the id in run.json (or, without run.json, the one
    or a path       run id its checkpoint manifests agree on); a fresh id when there is none.

Only rank 0 touches the directory. Other ranks learn the outcome (the run id, or rank 0's error, raised on
every rank alike) through `share`, a callable that every rank calls once with one value and that returns
rank 0's value (a broadcast; the caller picks the process group):

    claim = RunDir.claim(out_dir, resume=cfg.run.resume, overwrite=..., rank=rank, share=broadcast)
    ...  # checkpointer with run_id=claim.run_id, the run
    claim.release()

The lock is advisory and released by the operating system when the process dies, so a crashed run
never blocks the next one; it protects runs on one file system that honours flock.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from megatron_gptoss.checkpoint.manager import LATEST, MANIFEST, read_manifest
from megatron_gptoss.errors import CheckpointError, ConfigError, CorruptCheckpointError, MegatronGptossError

log = logging.getLogger(__name__)
LOCK_FILE = "run.lock"
IDENTITY_FILE = "run.json"
CHECKPOINTS = "checkpoints"
_ERRORS: dict[str, type[MegatronGptossError]] = {
    cls.__name__: cls for cls in (ConfigError, CheckpointError, CorruptCheckpointError)
}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def checkpoints_held(out_dir: Path) -> list[str]:
    """What `out_dir/checkpoints` holds, one entry per step directory (with its run id when its manifest
    names one), partial save or `latest` pointer; empty when there is nothing."""
    root = out_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    held = []
    for path in sorted(root.iterdir()):
        if path.name.startswith("step_") and path.is_dir():
            try:
                run_id = read_manifest(path).get("run_id")
                held.append(f"{path.name} (run {run_id})" if run_id else path.name)
            except CorruptCheckpointError:
                held.append(f"{path.name} (incomplete: no readable {MANIFEST})")
        elif path.name.endswith(".partial") or path.name == LATEST:
            held.append(path.name)
    return held


def _manifest_run_ids(out_dir: Path) -> set[str]:
    root = out_dir / CHECKPOINTS
    ids = set()
    for path in root.glob("step_*") if root.is_dir() else []:
        try:
            run_id = read_manifest(path).get("run_id")
        except CorruptCheckpointError:
            continue
        if run_id:
            ids.add(str(run_id))
    return ids


class RunDir:
    """A claimed output directory: `path`, the run's `run_id` (every rank), `resumed` (whether the run
    continues the directory's identity rather than starting a new one). Rank 0 holds the lock until
    `release()` (or the end of a `with` block, or the process)."""

    def __init__(self, path: Path, run_id: str, resumed: bool, lock_fd: int | None):
        self.path, self.run_id, self.resumed = path, run_id, resumed
        self._lock_fd = lock_fd

    @property
    def checkpoints(self) -> Path:
        """The directory of the run's checkpoints."""
        return self.path / CHECKPOINTS

    @classmethod
    def claim(
        cls,
        out_dir: str | os.PathLike,
        *,
        resume: str,
        overwrite: bool = False,
        rank: int = 0,
        share: Callable[[Any], Any] | None = None,
    ) -> RunDir:
        """Claim `out_dir` for this run (module docstring). Collective through `share` when given (every
        rank calls `claim`); without it only a single process (rank 0) may call it. Raises ConfigError on
        every rank when another live run holds the directory, when a new run would mix with another
        run's checkpoints or replace another run's outputs (without `overwrite`), or when the directory
        cannot be created or locked."""
        path = Path(out_dir)
        if rank != 0 and share is None:
            raise ValueError(f"rank {rank}: RunDir.claim needs `share` to learn rank 0's run id")
        outcome: dict[str, Any] = {}
        fd = None
        failure: BaseException | None = None
        if rank == 0:
            try:
                fd = _lock(path)
                outcome = _settle(path, resume, overwrite)
                _write_holder(fd, outcome["run_id"])
            except BaseException as err:  # shared below so that no rank waits for rank 0 forever
                failure = err
                if fd is not None:
                    os.close(fd)
                    fd = None
                kind = type(err).__name__ if type(err).__name__ in _ERRORS else "ConfigError"
                outcome = {"error": (kind, f"cannot claim {path}: {err}")}
        if share is not None:
            outcome = share(outcome if rank == 0 else None)
        if failure is not None:
            raise failure
        if "error" in outcome:
            kind, message = outcome["error"]
            raise _ERRORS[kind](f"rank 0: {message}")
        return cls(path, outcome["run_id"], outcome["resumed"], fd)

    def release(self) -> None:
        """Give the directory up (rank 0 unlocks; other ranks hold nothing). Idempotent."""
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock(path: Path) -> int:
    """The descriptor of `path/run.lock`, exclusively flock'ed; ConfigError naming the holder when a live
    run holds it, or saying why the directory cannot be used."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(f"cannot use output directory {path}: {err.strerror} ({err})") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        os.close(fd)
        try:
            info = json.loads(holder)
            who = f"pid {info['pid']} on host {info['host']}, run {info['run_id']}, started {info['started']}"
        except (ValueError, KeyError, TypeError):
            who = "a process that has not written its details yet"
        raise ConfigError(
            f"output directory {path} is in use by another live run ({who}); wait for it to finish or "
            f"choose another output directory"
        ) from None
    return fd


def _write_holder(fd: int, run_id: str) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "started": _now()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)


def _settle(path: Path, resume: str, overwrite: bool) -> dict[str, Any]:
    """Rank 0, lock held: the run id and whether it continues the directory's run (module docstring)."""
    identity = _read_identity(path)
    if resume:
        if identity is not None:
            return {"run_id": identity["run_id"], "resumed": True}
        ids = _manifest_run_ids(path)
        if len(ids) > 1:
            raise ConfigError(
                f"{path / CHECKPOINTS} holds checkpoints of several runs ({sorted(ids)}) and no "
                f"{IDENTITY_FILE}: resume one by its path in a new output directory"
            )
        if ids:
            run_id = ids.pop()
            log.warning(
                "%s has no %s: continuing run %s named by its checkpoints", path, IDENTITY_FILE, run_id
            )
            _write_identity(path, run_id)
            return {"run_id": run_id, "resumed": True}
        return {"run_id": _new_identity(path), "resumed": False}
    held = checkpoints_held(path)
    owner = f"run {identity['run_id']}" if identity is not None else "an earlier run"
    if held and not overwrite:
        raise ConfigError(
            f"output directory {path} holds checkpoints of {owner}: {', '.join(held)}. A new run "
            f"(no resume) does not mix with them: resume with resume=auto, choose another output "
            f"directory, or overwrite them (run.overwrite=true)"
        )
    if identity is not None and not overwrite:
        raise ConfigError(
            f"output directory {path} belongs to {owner} (its {IDENTITY_FILE}, created "
            f"{identity.get('created')}), which left no checkpoint; a new run would replace its outputs "
            f"(metrics, hf_final): choose another output directory, continue it with resume=auto, or "
            f"overwrite it (run.overwrite=true)"
        )
    if held:
        log.warning("overwrite: deleting the checkpoints of %s in %s: %s", owner, path, ", ".join(held))
        shutil.rmtree(path / CHECKPOINTS)
    elif identity is not None:
        log.warning("overwrite: a new run replaces %s in %s", owner, path)
    return {"run_id": _new_identity(path), "resumed": False}


def _read_identity(path: Path) -> dict[str, Any] | None:
    file = path / IDENTITY_FILE
    if not file.exists():
        return None
    try:
        identity = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file} is unreadable ({err}): restore it or remove it") from err
    if not isinstance(identity, dict) or not isinstance(identity.get("run_id"), str):
        raise ConfigError(f"{file} names no run_id: restore it or remove it")
    return identity


def _new_identity(path: Path) -> str:
    run_id = uuid.uuid4().hex
    _write_identity(path, run_id)
    log.info("new run %s in %s", run_id, path)
    return run_id


def _write_identity(path: Path, run_id: str) -> None:
    """Write run.json atomically (temporary file, fsync, rename)."""
    tmp = path / f".{IDENTITY_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, "created": _now(), "host": socket.gethostname()}))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path / IDENTITY_FILE)
