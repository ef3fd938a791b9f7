"""Sharded checkpoints of a parallel run with `torch.distributed.checkpoint`: save, load into any
layout, resume after a crash, save in the background.

    step_000010/                  a `CheckpointManager` step directory (atomic: partial name, fsync, rename,
      __<rank>_0.distcp           `latest` last); one file per rank with what that rank owns (`dist_state`)
      .metadata                   DCP's index: every tensor's full shape and chunks (written by rank 0)
      manifest.json               format, step, model config, layout, run config, sha256 of every file

Contents (layout-independent: every tensor full-shaped and unpadded, so any tp/ep/pp/dp layout, and a
different vocabulary padding, loads it): the parameters of each module group ("model", "reference"),
the distributed optimizer's fp32 master weights and AdamW moments, and blobs: "run" (a `RunState`:
step, data/prompt iterator position, RL state, metrics cursor, the optimizer's step counts; written by
rank 0) and "rank/<r>" (rank r's random streams and its own `rank_state`, written by rank r).

All methods are collective over `group`, a process group of every rank that only the checkpointer uses
(the background save runs its collectives on it while training uses the others): for example
`dist.new_group(backend="gloo")`, created by every rank at start-up.

    ckpt = DistributedCheckpointer(CheckpointManager(root, keep_last), dims, model_config, group)
    loaded = ckpt.resume("auto", {"model": models}, optimizer)        # None: start fresh
    ckpt.save(step, {"model": models}, optimizer, RunState(step, data={...}))   # or save_async + wait

LoRA runs (`model.lora.rank > 0`): only the adapters of each module group and their optimizer state are
stored (the base is frozen), with the manifest's `base` naming where the base weights come from (the
`run.init_from_hf` directory, or the random initialisation's seed); loading fills the adapters only, into
a model whose base the caller has already initialised from that source, and refuses a checkpoint whose
base differs from the run's.

Resuming in the same layout is exact (bit for bit: parameters, master weights, moments, step counts and
random streams); in another layout the tensors are exact and the random streams restart from the run's
seeding (a rank of one layout has no counterpart in another), which is logged.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from megatron_gptoss.checkpoint.dist_boxes import full_shapes
from megatron_gptoss.checkpoint.dist_planner import Piece, describe_failure, load_pieces, save_pieces
from megatron_gptoss.checkpoint.dist_state import (
    module_pieces,
    module_targets,
    optimizer_pieces,
    optimizer_steps,
    optimizer_targets,
    param_names,
    reset_optimizer,
    rng_state,
    set_rng_state,
)
from megatron_gptoss.checkpoint.lora_base import base_reference, check_adapters
from megatron_gptoss.checkpoint.manager import (
    CheckpointManager,
    CorruptCheckpointError,
    describe_os_error,
    file_sha256,
    read_manifest,
    unusable,
)
from megatron_gptoss.config import ModelConfig, TrainConfig, config_to_dict
from megatron_gptoss.errors import CheckpointError, CheckpointSaveError
from megatron_gptoss.model.value import VALUE_HEAD
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
from megatron_gptoss.parallel.dims import Layout, ParallelDims

log = logging.getLogger(__name__)
FORMAT = "megatron_gptoss.dcp/1"
# Fields of ModelConfig that fix tensor shapes: a checkpoint must agree on all of them.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "num_experts",
    "add_bias_linear",
)
DEFAULT_MAX_CHUNK_BYTES = 256 << 20


@dataclass
class RunState:
    """Run-wide state beside the tensors: plain containers of numbers and strings."""

    step: int  # optimizer steps completed
    data: dict = field(default_factory=dict)  # data / prompt iterator position
    rl: dict = field(default_factory=dict)  # RL state (e.g. whether a reference policy is kept)
    metrics: dict = field(default_factory=dict)  # metrics cursor (e.g. the next step to log)


@dataclass
class Loaded:
    path: Path
    run: RunState
    rank_state: dict | None  # this rank's `rank_state` (None when the layout changed)
    same_layout: bool


def layout_dict(layout: Layout, shard: bool | None, pipeline_layers: Sequence[int] | None) -> dict[str, Any]:
    return {
        "world": layout.world,
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "vpp": layout.vpp,
        "cp": layout.cp,
        "dp": layout.dp,
        "edp": layout.edp,
        "distributed_optimizer": shard,
        "pipeline_layers": list(pipeline_layers) if pipeline_layers else None,
    }


def check_model(manifest: Mapping[str, Any], config: ModelConfig, path: Path) -> None:
    """CheckpointError naming every shape field in which the checkpoint's model differs from `config`."""
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a distributed checkpoint of this project (format {manifest.get('format')!r}, "
            f"expected {FORMAT!r})"
        )
    stored = manifest["model"]
    diffs = [
        f"{name} {stored.get(name)} (checkpoint) != {getattr(config, name)} (this run)"
        for name in SHAPE_FIELDS
        if stored.get(name) != getattr(config, name)
    ]
    if diffs:
        raise CheckpointError(f"{path} holds a model of another shape: " + "; ".join(diffs))


class DistributedCheckpointer:
    """Save / load / resume of this rank's part of a parallel run (module docstring). `run_config` (the
    run's whole config as a dict) goes into the manifest; `max_chunk_bytes` bounds every stored chunk."""

    def __init__(
        self,
        manager: CheckpointManager,
        dims: ParallelDims,
        config: ModelConfig,
        group: dist.ProcessGroup,
        *,
        run_config: Mapping[str, Any] | None = None,
        pipeline_layers: Sequence[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    ):
        if dist.get_world_size(group) != dims.layout.world:
            raise ValueError(
                f"the checkpoint group has {dist.get_world_size(group)} ranks, the run {dims.layout.world}"
            )
        self.manager, self.dims, self.config, self.group = manager, dims, config, group
        self.rank = dist.get_rank(group)
        self.run_config = dict(run_config or {})
        self.pipeline_layers = pipeline_layers
        self.max_chunk_bytes = max_chunk_bytes
        self.coords = dims.layout.coords(dims.rank)
        self.adapters_only = config.lora.enabled
        # the policy's parameters, and the value head of a critic (module group "critic")
        self.shapes = {**full_shapes(config), VALUE_HEAD: (1, config.hidden_size)}
        self._pending: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}

    @classmethod
    def for_run(
        cls, cfg: TrainConfig, dims: ParallelDims, *, run_id: str | None = None
    ) -> DistributedCheckpointer:
        """The checkpointer of a training run (collective: builds a gloo group over the world): under
        `run.output_dir/checkpoints`, the newest `run.keep_last` verified ones kept, the run's config and
        `run_id` (`RunDir.claim(...).run_id`, the same on every rank) in the manifest; `locate("auto")`
        then resumes only checkpoints of that run."""
        root = Path(cfg.run.output_dir) / "checkpoints"
        return cls(
            CheckpointManager(root, keep_last=cfg.run.keep_last, run_id=run_id),
            dims,
            cfg.model,
            dist.new_group(backend="gloo"),
            run_config=config_to_dict(cfg),
            pipeline_layers=cfg.parallel.pipeline_layers or None,
        )

    # ----------------------------------------------------------------------------------------------
    # Save
    def save(
        self,
        step: int,
        modules: Mapping[str, Sequence[nn.Module]],
        optimizer: DistributedOptimizer | None,
        run: RunState,
        rank_state: Mapping[str, Any] | None = None,
        group_optimizers: Mapping[str, DistributedOptimizer] | None = None,
    ) -> Path:
        """Write the checkpoint of `step` and return its directory. Raises CheckpointSaveError on every
        rank when any rank fails; the previous checkpoints stay as they were. `group_optimizers`: the
        optimizers of other module groups (e.g. {"critic": its optimizer}), stored as `optim.<group>/...`."""
        self.wait()
        extra = dict(group_optimizers or {})
        partial, meta, pieces, blobs = self._prepare(step, modules, optimizer, run, rank_state, False, extra)
        return self._write_and_commit(step, partial, meta, pieces, blobs)

    def save_async(
        self,
        step: int,
        modules: Mapping[str, Sequence[nn.Module]],
        optimizer: DistributedOptimizer | None,
        run: RunState,
        rank_state: Mapping[str, Any] | None = None,
        group_optimizers: Mapping[str, DistributedOptimizer] | None = None,
    ) -> None:
        """Copy what this rank writes to host memory (one copy of its share: the parameters it writes and
        its part of the optimizer state; each copy is freed once written), then write and commit in a
        background thread; training may go on at once. `wait()` returns the directory (or raises the
        save's error); every other method waits first."""
        self.wait()
        extra = dict(group_optimizers or {})
        partial, meta, pieces, blobs = self._prepare(step, modules, optimizer, run, rank_state, True, extra)
        self._outcome = {}

        def work() -> None:
            try:
                self._outcome["path"] = self._write_and_commit(step, partial, meta, pieces, blobs)
            except BaseException as err:  # handed to wait() in the caller's thread
                self._outcome["error"] = err

        self._pending = threading.Thread(target=work, name=f"checkpoint-step-{step}", daemon=True)
        self._pending.start()

    def busy(self) -> bool:
        """Whether a background save is still writing."""
        return self._pending is not None and self._pending.is_alive()

    def wait(self) -> Path | None:
        """Finish the background save, if any: its directory, or its error raised here."""
        if self._pending is None:
            return None
        self._pending.join()
        self._pending = None
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome.get("path")

    def _prepare(self, step, modules, optimizer, run, rank_state, stage: bool, extra: dict):
        """Collective: every rank lists its pieces and blobs (an error on any rank stops the save on all,
        before any file is written), then rank 0 opens the partial directory."""
        pieces: list[Piece] = []
        blobs: dict[str, object] = {}
        error = None
        try:
            pieces, blobs = self._collect(modules, optimizer, run, rank_state, stage, extra)
        except Exception as err:  # agreed on below: no rank may enter the save's collectives alone
            error = f"rank {self.rank}: {type(err).__name__}: {err}"
        errors = self._all_errors(error)
        opened = None
        if self.rank == 0 and not errors:
            try:
                opened = str(self.manager.begin(step))
            except CheckpointSaveError as err:
                errors = [f"rank 0: {err}"]
        errors, opened = self._broadcast([errors, opened])
        if errors:
            raise CheckpointSaveError(f"checkpoint of step {step} not saved: " + "; ".join(errors))
        partial = Path(opened)
        meta = {
            "format": FORMAT,
            "model": dataclasses.asdict(self.config),
            "layout": self._layout(optimizer),
            "contents": {
                "modules": sorted(modules),
                "optimizer": optimizer is not None,
                "group_optimizers": sorted(extra),
                "adapters_only": self.adapters_only,
            },
            "base": self.base_reference(),
            "config": self.run_config,
        }
        return partial, meta, pieces, blobs

    def _collect(self, modules, optimizer, run, rank_state, stage: bool, extra: dict):
        """This rank's pieces (host copies when `stage`) and blobs."""
        names = {prefix: param_names(models) for prefix, models in modules.items()}
        pieces: list[Piece] = []
        for prefix, models in modules.items():
            pieces += module_pieces(
                prefix,
                models,
                self.coords,
                self.shapes,
                self.config.vocab_size,
                self.max_chunk_bytes,
                self.adapters_only,
            )
        blobs: dict[str, object] = {
            f"rank/{self.rank}": {"rng": rng_state(), "state": dict(rank_state or {})}
        }
        steps = None
        if optimizer is not None:
            owner = names.get("model") or next(iter(names.values()))
            pieces += optimizer_pieces(
                optimizer, owner, self.coords, self.shapes, self.config.vocab_size, self.max_chunk_bytes
            )
            steps = optimizer_steps(optimizer)
        group_steps = {}
        for group, opt in extra.items():
            shapes, vocab, chunk = self.shapes, self.config.vocab_size, self.max_chunk_bytes
            pieces += optimizer_pieces(opt, names[group], self.coords, shapes, vocab, chunk, f"optim.{group}")
            group_steps[group] = optimizer_steps(opt)
        if self.rank == 0:
            blobs["run"] = {**dataclasses.asdict(run), "optimizer": steps, "group_optimizers": group_steps}
        if stage:
            pieces = [
                dataclasses.replace(p, data=p.data.detach().to("cpu", copy=True), owned=True)  # type: ignore[union-attr]
                for p in pieces
            ]
        return pieces, blobs

    def _all_errors(self, error: str | None) -> list[str]:
        """Collective: the errors of every rank (sorted, without repeats)."""
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, error, group=self.group)
        return sorted({e for e in gathered if e})

    def _write_and_commit(self, step, partial: Path, meta, pieces, blobs) -> Path:
        error = None
        checksums: dict[str, str] = {}
        try:
            save_pieces(partial, pieces, blobs, self.group)
            checksums[f"__{self.rank}_0.distcp"] = file_sha256(partial / f"__{self.rank}_0.distcp")
            if self.rank == 0:
                checksums[".metadata"] = file_sha256(partial / ".metadata")
        except (Exception, CheckpointException) as err:
            error = f"rank {self.rank} writing {partial}: {describe_failure(err)}"
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (error, checksums), group=self.group)
        errors = sorted({e for e, _ in gathered if e})
        final = None
        if self.rank == 0:
            try:
                if errors:
                    shutil.rmtree(partial, ignore_errors=True)
                else:
                    sums = {name: digest for _, part in gathered for name, digest in part.items()}
                    final = str(self.manager.commit(step, partial, meta, sums))
            except CheckpointSaveError as err:  # commit removed the partial directory
                errors = [f"rank 0: {err}"]
            except OSError as err:
                shutil.rmtree(partial, ignore_errors=True)
                errors = [f"rank 0: {describe_os_error(err, partial)}"]
            final = final if not errors else "\n".join(errors)
        outcome = self._broadcast([final, errors])
        if outcome[1]:
            raise CheckpointSaveError(
                f"checkpoint of step {step} not saved ({self.manager.root}: earlier checkpoints and "
                f"'latest' untouched): " + "; ".join(outcome[1])
            )
        if self.rank == 0:
            log.info("saved checkpoint %s", outcome[0])
        return Path(outcome[0])

    def _layout(self, optimizer: DistributedOptimizer | None) -> dict[str, Any]:
        shard = optimizer.shard if optimizer is not None else None
        return layout_dict(self.dims.layout, shard, self.pipeline_layers)

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    # ----------------------------------------------------------------------------------------------
    # Load
    def load(
        self,
        path: str | Path,
        modules: Mapping[str, Sequence[nn.Module]],
        optimizer: DistributedOptimizer | None,
        group_optimizers: Mapping[str, DistributedOptimizer] | None = None,
    ) -> Loaded:
        """Fill `modules` (and `optimizer`, and `group_optimizers` as `save` stored them) from the
        checkpoint at `path`, saved in any layout. The files' checksums are not verified here
        (`find_resumable` does). Raises CheckpointError for another model shape, a missing tensor or module
        group, a shape or coverage mismatch (every rank alike)."""
        extra = dict(group_optimizers or {})
        self.wait()
        path = Path(path)
        manifest = self._manifest(path)
        check_model(manifest, self.config, path)
        check_adapters(manifest, self.config, self.base_reference(), path)
        adapters_only = bool(manifest["contents"].get("adapters_only", False))
        absent = sorted(set(modules) - set(manifest["contents"]["modules"]))
        if absent:
            raise CheckpointError(f"{path} holds no {absent} (it has {manifest['contents']['modules']})")
        same = manifest["layout"] == self._layout(optimizer)
        targets: list = []
        install = None
        installs: dict[str, Any] = {}
        problems = []
        try:
            with torch.no_grad():
                for prefix, models in modules.items():
                    vocab = self.config.vocab_size
                    targets += module_targets(prefix, models, self.coords, vocab, adapters_only)
                if optimizer is not None and manifest["contents"]["optimizer"]:
                    owner = param_names(modules.get("model") or next(iter(modules.values())))
                    more, install = optimizer_targets(optimizer, owner, self.coords, self.config.vocab_size)
                    targets += more
                for group in set(extra) & set(manifest["contents"].get("group_optimizers", [])):
                    names = param_names(modules[group])
                    prefix = f"optim.{group}"
                    more, installs[group] = optimizer_targets(
                        extra[group], names, self.coords, self.config.vocab_size, prefix
                    )
                    targets += more
            shapes = {t.fqn: self.shapes[t.fqn.split("/", 2)[-1]] for t in targets}
        except Exception as err:  # reported with every rank's problems by load_pieces
            problems.append(f"rank {self.rank}: {type(err).__name__}: {err}")
            shapes = {}
        blob_keys = ["run"] + ([f"rank/{self.rank}"] if same else [])
        with torch.no_grad():
            blobs = load_pieces(path, targets, shapes, blob_keys, self.group, problems)
        run_blob = dict(blobs["run"])  # type: ignore[call-overload]
        steps = run_blob.pop("optimizer")
        group_steps = run_blob.pop("group_optimizers", {})
        for group, opt in extra.items():  # a group optimizer the checkpoint lacks starts from the weights
            if group in installs:
                installs[group](group_steps[group])
            else:
                reset_optimizer(opt)
        if install is not None:
            install(steps)
        elif optimizer is not None:
            reset_optimizer(optimizer)
            if self.rank == 0:
                log.info("%s has no optimizer state: master weights taken from the parameters", path)
        rank_state = None
        if same:
            rank_blob = blobs[f"rank/{self.rank}"]
            set_rng_state(rank_blob["rng"])  # type: ignore[index]
            rank_state = dict(rank_blob["state"])  # type: ignore[index]
        elif self.rank == 0:
            log.info(
                "%s was saved in layout %s, this run is %s: tensors resharded, random streams not restored",
                path,
                manifest["layout"],
                self._layout(optimizer),
            )
        return Loaded(path, RunState(**run_blob), rank_state, same)

    def base_reference(self) -> dict[str, Any] | None:
        """Where this run's LoRA base comes from (`lora_base.base_reference`; None without LoRA)."""
        return base_reference(self.config, self.run_config)

    def _manifest(self, path: Path) -> dict[str, Any]:
        return read_manifest(path)

    # ----------------------------------------------------------------------------------------------
    # Resume
    def find_resumable(self) -> Path | None:
        """The newest checkpoint of this run whose files all match their checksums, starting from
        `latest`; the ranks share the hashing (rank r checks every world-th file). Skipped checkpoints are
        logged by rank 0 with the file at fault. None when there is no complete checkpoint;
        CorruptCheckpointError on every rank, naming each checkpoint and why, when there are some but
        none is usable."""
        self.wait()
        candidates = self._broadcast([str(p) for p in self.manager.candidates()] if self.rank == 0 else None)
        problems: list[tuple[str, str]] = []
        for candidate in candidates:
            path = Path(candidate)
            bad = self._verify_shared(path, own_run=True)
            if not bad:
                self.manager.mark_verified(path)
                return path
            problems.append((path.name, "; ".join(bad)))
            if self.rank == 0:
                log.warning("skipping checkpoint %s: %s", path.name, "; ".join(bad))
        if problems:
            raise unusable(self.manager.root, problems)
        return None

    def _verify_shared(self, path: Path, own_run: bool = False) -> list[str]:
        """Collective: the problems of checkpoint `path` (missing or corrupted files named; with `own_run`,
        a checkpoint of another run), hashed by all ranks together (rank r checks every world-th file of
        the manifest)."""
        world = dist.get_world_size(self.group)
        error = None
        try:
            manifest = self._manifest(path)
            if own_run:
                self.manager.check_run(manifest, path)
            self.manager.verify(path, sorted(manifest["files"])[self.rank :: world])
        except (CheckpointError, OSError, ValueError) as err:
            error = str(err)
        return self._all_errors(error)

    def locate(self, resume: str) -> Path | None:
        """The checkpoint `resume` names, verified (collective): "" -> None (start fresh); "auto" -> the
        newest complete checkpoint of this run whose files match their checksums (None when the directory
        holds no complete checkpoint; CorruptCheckpointError naming each one and why when none of those it
        holds is usable); a directory -> itself, or CorruptCheckpointError naming its bad files. Callers
        can build their weights (or skip an initialisation the checkpoint would overwrite) before
        `resume_from`."""
        if not resume:
            return None
        if resume == "auto":
            path = self.find_resumable()
            if path is None and self.rank == 0:
                log.info("no checkpoint to resume in %s; starting fresh", self.manager.root)
            return path
        path = Path(resume)
        bad = self._verify_shared(path)
        if bad:
            raise CorruptCheckpointError(f"cannot resume from {path}: " + "; ".join(bad))
        if path.parent == self.manager.root:
            self.manager.mark_verified(path)
        return path

    def resume_from(
        self,
        path: Path,
        modules: Mapping[str, Sequence[nn.Module]],
        optimizer: DistributedOptimizer | None,
        group_optimizers: Mapping[str, DistributedOptimizer] | None = None,
    ) -> Loaded:
        """`load` of a checkpoint from `locate`, logged."""
        loaded = self.load(path, modules, optimizer, group_optimizers)
        if self.rank == 0:
            log.info("resumed from %s (step %d)", path, loaded.run.step)
        return loaded

    def resume(
        self,
        resume: str,
        modules: Mapping[str, Sequence[nn.Module]],
        optimizer: DistributedOptimizer | None,
    ) -> Loaded | None:
        """`locate` then `resume_from`: None when there is nothing to resume."""
        path = self.locate(resume)
        return None if path is None else self.resume_from(path, modules, optimizer)
