"""Per-step metrics: one JSON object per line in `<output_dir>/metrics.jsonl`, mirrored to TensorBoard and
to experiment trackers (W&B, MLflow: `utils.trackers`).

File format: each line is `{"step": <int>, "<name>": <float>, ...}`, names flat and slash-separated
("reward/train_mean", "mismatch/k3"), values floats (ints and bools converted). Non-finite values
are written as the bare words NaN / Infinity, which Python's `json` reads back. A line is written
and flushed per `log` call, so a crash loses no step already logged; at worst the step being
written is left as a partial last line, which `read_metrics` skips and a new logger removes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_gptoss.utils.trackers import Tracker

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLogger:
    """Append-only JSONL log of scalar metrics (and TensorBoard scalars when enabled, and `trackers`).

    On construction an existing `<output_dir>/metrics.jsonl` is kept: with `resume_step`, only its
    lines with step < resume_step survive (the run restarts at resume_step and rewrites the rest);
    without it, new lines are appended. TensorBoard events go to `<output_dir>/tensorboard`
    (purged from resume_step on); if TensorBoard cannot be imported, a warning is logged once
    and only the JSONL is written. Each of `trackers` receives what each line holds; one that raises is
    reported in one line and dropped (the JSONL keeps every step); `close` closes them.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        tensorboard: bool = True,
        resume_step: int | None = None,
        trackers: Sequence[Tracker] = (),
    ):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        if self.path.exists():
            _keep_complete_lines(self.path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._writer = (
            _summary_writer(self.output_dir / TENSORBOARD_DIR, resume_step) if tensorboard else None
        )
        self._trackers = list(trackers)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Write one line for `step` and return the flat dict written (without "step").

        `metrics` maps names to numbers, 0-d or one-element tensors (read with `.item()`), or
        nested mappings (flattened with "/"). Raises ValueError naming the key for a value that is
        not a scalar, or for a key "step", and RuntimeError after `close`.
        """
        if self._file.closed:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        flat = flatten_metrics(metrics)
        if "step" in flat:
            raise ValueError("metric name 'step' is reserved for the step number")
        self._file.write(json.dumps({"step": int(step), **flat}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for name, value in flat.items():
                self._writer.add_scalar(name, value, int(step))
        for tracker in list(self._trackers):
            try:
                tracker.log(int(step), flat)
            except Exception as err:  # a tracker's failure (a server gone, say) does not stop training
                logger.error(
                    "%s failed at step %d and receives no more metrics (%s: %s); %s keeps every step",
                    type(tracker).__name__, step, type(err).__name__, err, self.path,
                )  # fmt: skip
                self._trackers.remove(tracker)
                _close_quietly(tracker, failed=True)
        return flat

    def close(self, failed: bool = False) -> None:
        """Flush and close the JSONL file, the TensorBoard writer and the trackers (`failed`: their runs are
        marked failed); calling it again does nothing."""
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            _close_quietly(tracker, failed)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(failed=exc[0] is not None)


def run_name(output_dir: str | os.PathLike) -> str:
    """The name a run is shown under (plot titles, W&B, MLflow): its output directory's name, never the
    machine's path to it."""
    return Path(output_dir).resolve().name or "run"


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """{"a": {"b": t}} -> {"a/b": float(t)}; scalars of any kind (tensor, numpy, bool) become float."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, prefix=f"{name}/"))
            continue
        if hasattr(value, "numel") and value.numel() != 1:
            raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}, not a scalar")
        if hasattr(value, "item"):
            value = value.item()
        if not isinstance(value, (int, float)):  # bool is an int
            raise ValueError(f"metric {name!r} = {value!r} ({type(value).__name__}) is not a number")
        flat[name] = float(value)
    return flat


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """The records of a metrics.jsonl, in file order, each with "step" as an int.

    A partial last line (a write cut short by a crash) is skipped; a malformed earlier line raises
    ValueError naming the line number.
    """
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # the last piece has no newline: an unfinished write
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({err})") from err
        record["step"] = int(record["step"])
        records.append(record)
    return records


def _keep_complete_lines(path: Path, resume_step: int | None) -> None:
    """Drop an unfinished last line and, with `resume_step`, every record with step >= resume_step."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    tail = lines.pop()  # the piece after the last newline: empty, or a write cut short
    if tail.strip() and _parses(tail):
        lines.append(tail)
    lines = [line for line in lines if line.strip()]
    if resume_step is not None:
        lines = [line for line in lines if int(json.loads(line)["step"]) < resume_step]
    kept = "".join(line + "\n" for line in lines)
    if kept == text:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(kept, encoding="utf-8")
    os.replace(tmp, path)


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _close_quietly(tracker: Tracker, failed: bool) -> None:
    """Close a tracker, reporting rather than raising its failure (the run's own outcome stands)."""
    try:
        tracker.close(failed)
    except Exception as err:
        logger.error("closing %s failed (%s: %s)", type(tracker).__name__, type(err).__name__, err)


def _summary_writer(log_dir: Path, resume_step: int | None) -> Any:
    """A TensorBoard SummaryWriter, or None (with one warning) if TensorBoard is not importable."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        logger.warning("TensorBoard logging disabled (%s); metrics go to the JSONL file only", err)
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=resume_step)
