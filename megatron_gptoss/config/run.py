"""Configuration of a run: mode, length, precision, output directory, checkpoints, watchdog and guards."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gptoss.config.checks import DTYPES, check_at_least, check_positive
from megatron_gptoss.config.loggers import check_loggers
from megatron_gptoss.errors import ConfigError

RUN_MODES = ("rl", "sft")


@dataclass
class RunConfig:
    """The run: what it trains, length, precision, logging, checkpoints."""

    # "rl": the RL loop (generate, score, PPO update, weight sync); "sft": supervised next-token training.
    mode: str = "rl"
    # Training steps (RL: one rollout batch each; SFT: one optimizer step each).
    steps: int = 100
    # Evaluate every this many steps (0: only at start and end; >= 0).
    eval_every: int = 10
    # Parameter dtype of the learner: "float32" or "bfloat16" (fp32 master weights either way).
    dtype: str = "float32"
    # Directory of metrics, plots and checkpoints.
    output_dir: str = "outputs/run"
    # Resumable checkpoints: > 0 every this many steps and after the last step, 0 only after the last step,
    # < 0 never (benchmarks).
    save_every: int = 0
    # Resumable checkpoints kept (the newest complete ones; >= 1).
    keep_last: int = 2
    # Resume: "" starts fresh, "auto" takes the newest complete checkpoint in output_dir, or a path.
    # A fresh run (resume "") into an output_dir holding another run's checkpoints is refused unless this is
    # set; then those checkpoints are deleted and the metrics log restarts.
    overwrite: bool = False
    resume: str = ""
    # Write checkpoints in a background thread (host copies first) so training goes on during the write.
    async_save: bool = False
    # Seed of model initialisation and sampling.
    seed: int = 0
    # Start from an HF GPT-OSS directory instead of a random initialisation.
    init_from_hf: str = ""
    # Torch intra-op threads (0: on a GPU rank 1 unless OMP_NUM_THREADS is set, see
    # utils.host.set_host_threads; on the CPU torch's default).
    num_threads: int = 0
    # GiB of device memory this process may allocate (torch.cuda.set_per_process_memory_fraction): a smaller
    # card's budget on a larger one; an allocation beyond it fails as out of memory. 0: the whole device.
    device_memory_gib: float = 0.0
    # Python's garbage collector: off during the steps and a full collection every this many steps, between
    # them (a collection inside a step stalls the host that feeds the GPU); 0 leaves it to Python.
    gc_every: int = 10
    # Where each step's metrics go (rank 0): "jsonl" (output_dir/metrics.jsonl: always written, listed or
    # not), "tensorboard" (output_dir/tensorboard), "wandb" (Weights & Biases: its run id is run.json's, so
    # `--resume auto` continues it; WANDB_MODE=offline keeps it on disk, in output_dir/wandb), "mlflow"
    # (MLflow: a local store, output_dir/mlflow.db, unless MLFLOW_TRACKING_URI names one). wandb and mlflow
    # need the extras of the same names (pip install -e '.[wandb,mlflow]').
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    # TensorBoard events are written when this is true and run.loggers lists "tensorboard" (false turns
    # them off whatever run.loggers says).
    tensorboard: bool = True
    # Show a progress bar.
    progress: bool = True
    # Write the final policy as an HF directory (bf16) to output_dir/hf_final at the end of the run.
    export_hf: bool = True
    # Stop gracefully (checkpoint at the end of the current step, exit 0) once this file exists; SIGTERM or
    # SIGUSR1 to any rank does the same.
    stop_file: str = ""
    # Seconds a collective may wait for the other ranks before the run fails (a stalled or lost rank).
    collective_timeout_s: float = 300.0
    # Seconds without a heartbeat from a rank (stopped, dead, host lost) before every other rank ends the job
    # with exit code 87 naming it (0: no watchdog; runs only where the trainer made the process group).
    watchdog_stall_s: float = 120.0
    # Seconds between heartbeats and between checks of the other ranks (< watchdog_stall_s / 2).
    watchdog_interval_s: float = 5.0
    # Seconds a rank's loop may go without a new step before the job is ended (0: off); must exceed the
    # longest step, generation, evaluation and checkpoint save included.
    watchdog_step_stall_s: float = 0.0
    # Skipped steps in a row (non-finite loss or gradient norm) that stop the run with DivergenceError
    # (0: never).
    max_consecutive_skips: int = 5
    # A finite |loss| above this stops the run without saving the step's weights.
    max_loss: float = 1.0e4
    # A finite gradient norm (before clipping) above this stops the run without saving the step's weights.
    max_grad_norm: float = 1.0e6
    # An update moving the weights by more than this fraction of their norm (||after - before|| / ||before||)
    # stops the run without saving them (a learning rate that destroys the weights).
    max_update_ratio: float = 1.0
    # Steps in a row in which every reward of the step failed (the reward function raised, returned no finite
    # number, timed out or killed its worker) that stop the run, naming the function (0: never).
    max_reward_error_steps: int = 3

    def validate(self) -> None:
        check_positive("run", self, "steps")
        check_at_least("run", self, 0, "eval_every", "num_threads", "gc_every", "max_reward_error_steps")
        check_at_least("run", self, 0.0, "device_memory_gib")
        check_at_least("run", self, 1, "keep_last")
        check_loggers(self.loggers)
        if self.mode not in RUN_MODES:
            raise ConfigError(f"run.mode={self.mode!r} not in {RUN_MODES}")
        if not self.output_dir.strip():
            raise ConfigError(
                "run.output_dir is empty: name the run's own directory (it holds the run's lock, metrics and "
                "checkpoints; '.' for the current directory)"
            )
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"run.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        check_at_least("run", self, 0, "watchdog_stall_s", "watchdog_step_stall_s", "max_consecutive_skips")
        check_positive("run", self, "watchdog_interval_s", "max_loss", "max_grad_norm", "max_update_ratio")
        if self.watchdog_stall_s and self.watchdog_interval_s * 2 > self.watchdog_stall_s:
            raise ConfigError(
                f"run.watchdog_interval_s={self.watchdog_interval_s} must be at most half of "
                f"run.watchdog_stall_s={self.watchdog_stall_s}"
            )
        self._check_watchdog_before_timeout()
        if self.dtype not in DTYPES:
            raise ConfigError(f"run.dtype={self.dtype!r} not in {DTYPES}")

    def _check_watchdog_before_timeout(self) -> None:
        """The watchdog must name a stalled rank (within its stall bound plus two intervals) before a
        collective times out on the others, which ends them in a timeout error that names no rank."""
        if not self.watchdog_stall_s:
            return
        bounds = [("run.watchdog_stall_s", self.watchdog_stall_s)]
        if self.watchdog_step_stall_s:
            bounds.append(("run.watchdog_step_stall_s", self.watchdog_step_stall_s))
        for name, stall in bounds:
            needed = stall + 2 * self.watchdog_interval_s
            if self.collective_timeout_s <= needed:
                raise ConfigError(
                    f"run.collective_timeout_s={self.collective_timeout_s} must exceed {name}={stall} + 2 x "
                    f"run.watchdog_interval_s={self.watchdog_interval_s} (= {needed}): otherwise a stalled "
                    "rank ends the job in a collective timeout that does not name it, before the watchdog "
                    f"does. Raise run.collective_timeout_s or lower {name} (run.watchdog_stall_s=0 turns the "
                    "watchdog off)"
                )
