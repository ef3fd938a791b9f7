"""W&B (offline) and MLflow (the local store) receive what metrics.jsonl holds, across a resume; a logger
whose package is missing is one line naming the extra to install."""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from pathlib import Path

import pytest

from megatron_gptoss.config import load_config
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.trainer import loop
from megatron_gptoss.utils.metrics import read_metrics
from megatron_gptoss.utils.trackers import (
    MLFLOW_DB,
    PROJECT,
    RUN_ID_TAG,
    MlflowTracker,
    WandbTracker,
    mlflow_metric_name,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.preset=gpt_oss_tiny", "model.vocab_size=32", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "env.eval_size=4", "run.eval_every=0", "run.progress=false",
        "run.export_hf=false", "run.save_every=1"]  # fmt: skip


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline with its settings and caches under tmp_path; MLflow's default (local) store."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    for name in (
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)


def wandb_records(path: Path) -> list:
    """The records of a .wandb file (W&B's transaction log, LevelDB's log format: 32 KiB blocks of chunks,
    each with a CRC-32 over its type byte and data), read without a network, as W&B's protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little room left for a chunk header: the block is padded
            pos += 32768 - pos % 32768
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (checksum, length, kind) == (0, 0, 0):
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(out: Path) -> tuple[set[str], dict[int, dict[str, float]]]:
    """The run ids of every offline W&B run under `out` and their history rows merged by step (W&B's own
    keys, "_step" and the like, left out)."""
    run_ids, rows = set(), {}
    for file in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
            elif kind == "history":
                row = rows.setdefault(record.history.step.num, {})
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        row[key] = float(json.loads(item.value_json))
    return run_ids, rows


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_wandb_and_mlflow_receive_the_jsonl_metrics_across_a_resume(tmp_path, offline):
    out = tmp_path / "arith_run"
    common = [*TINY, f"run.output_dir={out}", "run.loggers=[jsonl,wandb,mlflow]"]
    first = loop.run(load_config(ROOT / "configs/demo_cpu.yaml", [*common, "run.steps=2"]))
    assert (first.status, first.step) == ("finished", 2)
    second = loop.run(
        load_config(ROOT / "configs/demo_cpu.yaml", [*common, "run.steps=3", "run.resume=auto"])
    )
    assert (second.status, second.step) == ("finished", 3)

    run_id = json.loads((out / "run.json").read_text())["run_id"]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: the first evaluation
    assert not (out / "tensorboard").exists()  # run.loggers does not list it

    run_ids, rows = wandb_history(out)
    assert run_ids == {run_id}  # both runs (one offline directory each) continue one W&B run
    assert len(list((out / "wandb").glob("offline-run-*"))) == 2
    assert sorted(rows) == [0, 1, 2, 3]
    for record in records:
        expected = {k: v for k, v in record.items() if k != "step"}
        row = rows[record["step"]]
        assert row.keys() == expected.keys()
        assert all(same(row[k], v) for k, v in expected.items()), record["step"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / MLFLOW_DB}")
    experiment = client.get_experiment_by_name(PROJECT)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags[RUN_ID_TAG] == run_id and run.info.run_name == "arith_run"
    assert run.info.status == "FINISHED" and run.data.params["run.output_dir"] == str(out)
    names = {name for record in records for name in record if name != "step"}
    assert {mlflow_metric_name(name) for name in names} == set(run.data.metrics)
    for name in names:
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_metric_name(name))
        )
        expected = [(r["step"], r[name]) for r in records if name in r]
        assert [s for s, _ in history] == [s for s, _ in expected], name
        assert all(same(a, b) for (_, a), (_, b) in zip(history, expected)), name


@pytest.mark.parametrize(
    ("logger", "module"), [("wandb", "wandb"), ("mlflow", "mlflow"), ("mlflow", "sqlalchemy")]
)
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it fails
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo_cpu.yaml", [*TINY, f"run.loggers=[jsonl,{logger}]"])
    message = str(err.value)
    assert "\n" not in message and "run.loggers" in message and f"'{module}' is not installed" in message
    assert f"megatron_gptoss[{logger}]" in message
    tracker = {"wandb": WandbTracker, "mlflow": MlflowTracker}[logger]
    with pytest.raises(ConfigError) as at_start:  # the package went away after the config was loaded
        tracker(tmp_path, "0" * 32, {})
    assert str(at_start.value) == message


@pytest.mark.parametrize(
    ("loggers", "problem"),
    [("[jsonl,neptune]", "unknown logger(s) ['neptune']"), ("[wandb,wandb]", "more than once")],
)
def test_bad_logger_lists_name_the_field(loggers, problem):
    with pytest.raises(ConfigError, match=r"run\.loggers") as err:
        load_config(ROOT / "configs/demo_cpu.yaml", [*TINY, f"run.loggers={loggers}"])
    assert problem in str(err.value)
