"""Configuration of everything beside the model: layout, optimizer, PPO, rollout, SFT, and the whole
`TrainConfig` (the environment and the run have their own modules: `config.env`, `config.run`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.config.algorithm import AlgorithmConfig
from megatron_gptoss.config.checks import DTYPES, check_at_least, check_positive
from megatron_gptoss.config.critic import CriticConfig
from megatron_gptoss.config.dapo import DAPOConfig
from megatron_gptoss.config.data import DataConfig
from megatron_gptoss.config.engine import EmbeddedEngineConfig, check_rollout_expert_format
from megatron_gptoss.config.env import EnvConfig
from megatron_gptoss.config.model import ModelConfig
from megatron_gptoss.config.moe import MoEReplayConfig
from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.config.run import RunConfig
from megatron_gptoss.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
PLACEMENTS = ("colocated", "separate")
CORRECTION_MODES = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis", "geo-tis", "geo-mis")
KL_ESTIMATORS = ("k1", "k2", "k3")
POLICY_LOSSES = ("ppo", "gspo", "gspo_token")


@dataclass
class ParallelConfig:
    """Parallel layout (Megatron names). The product tp x cp x pp x dp must equal the world size."""

    # Tensor model parallel size: attention heads and vocabulary are split across these ranks.
    tensor_model_parallel_size: int = 1
    # Pipeline model parallel size: layers are split into this many stages.
    pipeline_model_parallel_size: int = 1
    # Virtual pipeline stages per rank (interleaved schedule); 1 means plain 1F1B.
    virtual_pipeline_model_parallel_size: int = 1
    # Expert model parallel size: experts are split across these ranks (carved out of dp x tp).
    expert_model_parallel_size: int = 1
    # Shard norm/residual activations along the sequence over the tensor-parallel ranks.
    sequence_parallel: bool = False
    # Context parallel size: each packed micro-batch's tokens are split over these ranks in load-balanced
    # causal chunks (rank r holds chunks r and 2cp-1-r of 2cp); attention exchanges keys and values.
    context_parallel_size: int = 1
    # Expert parallel: each MoE layer's tokens in this many chunks, whose all-to-alls overlap the other
    # chunks' expert GEMMs (forward and backward); 1 exchanges all tokens at once.
    expert_dispatch_chunks: int = 1
    # Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer / ZeRO-1).
    use_distributed_optimizer: bool = False
    # Layers per (virtual) pipeline stage in stage order, e.g. [8, 10, 10, 8] (the first and last stages
    # also hold the embedding and the output layer); empty splits evenly, lighter at both ends.
    pipeline_layers: list[int] = field(default_factory=list)

    def validate(self) -> None:
        check_at_least(
            "parallel",
            self,
            1,
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "expert_dispatch_chunks",
            "context_parallel_size",
        )
        if any(count < 0 for count in self.pipeline_layers):
            raise ConfigError(f"parallel.pipeline_layers={self.pipeline_layers} has a negative count")
        if self.pipeline_layers:
            stages = self.pipeline_model_parallel_size * self.virtual_pipeline_model_parallel_size
            if len(self.pipeline_layers) != stages:
                raise ConfigError(
                    f"parallel.pipeline_layers has {len(self.pipeline_layers)} counts, the layout has "
                    f"{stages} (virtual) stages (pipeline {self.pipeline_model_parallel_size} x virtual "
                    f"{self.virtual_pipeline_model_parallel_size})"
                )


@dataclass
class OptimConfig:
    """AdamW with fp32 master weights."""

    # Peak learning rate.
    lr: float = 1e-6
    # Learning rate reached at the end of the decay.
    min_lr: float = 0.0
    # Linear warm-up steps.
    warmup_steps: int = 0
    # Schedule after warm-up: "constant" or "cosine".
    lr_schedule: str = "constant"
    # AdamW betas and epsilon.
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # Decoupled weight decay.
    weight_decay: float = 0.0
    # Clip the global gradient norm to this value (0 disables clipping).
    clip_grad: float = 1.0

    def validate(self) -> None:
        check_at_least("optim", self, 0, "lr", "min_lr", "warmup_steps", "weight_decay", "clip_grad")
        check_positive("optim", self, "adam_eps")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"optim.lr_schedule={self.lr_schedule!r} not in ('constant', 'cosine')")


@dataclass
class PPOConfig:
    """Policy loss, advantages and rollout correction."""

    # Surrogate: "ppo" (token ratio, clip-higher, dual clip), "gspo" (one length-normalised ratio per
    # sequence, clipped per sequence) or "gspo_token" (GSPO's ratio value with per-token gradients and
    # advantages). GSPO's paper clips far tighter than PPO (about 3e-4 / 4e-4): set clip_ratio_low / high.
    policy_loss: str = "ppo"
    # Lower clip: the ratio is clipped below at 1 - clip_ratio_low.
    clip_ratio_low: float = 0.2
    # Upper clip (clip-higher): the ratio is clipped above at 1 + clip_ratio_high.
    clip_ratio_high: float = 0.28
    # Dual clip constant c (> 1) bounding the loss of negative-advantage tokens; 0 disables it.
    clip_ratio_c: float = 3.0
    # Loss aggregation over the mini-batch.
    loss_agg_mode: str = "token-mean"
    # Coefficient of the KL penalty to the reference policy (0: no reference model kept).
    kl_coef: float = 0.0
    # KL estimator: "k1" (log ratio), "k2" (half the squared log ratio: its gradient is that of the KL) or
    # "k3" (Schulman's unbiased, non-negative).
    kl_estimator: str = "k3"
    # Upper bound of the per-token k3 estimate (0: none); tames tokens the reference finds very unlikely.
    kl_k3_max: float = 10.0
    # Entropy bonus coefficient (the loss subtracts coef x entropy).
    entropy_coef: float = 0.0
    # GRPO: divide advantages by the group's reward standard deviation.
    norm_adv_by_std: bool = True
    # Epsilon added to the group standard deviation.
    adv_eps: float = 1e-6
    # Passes over each rollout batch.
    ppo_epochs: int = 1
    # Optimizer steps per rollout batch (the batch is split into this many mini-batches).
    num_mini_batches: int = 1
    # Micro-batches per mini-batch (gradient accumulation).
    num_micro_batches: int = 1
    # Rollout correction: importance weights between learner old log-probs and rollout log-probs.
    correction_mode: str = "token-tis"
    # Truncation threshold (TIS) or upper mask threshold (MIS) of the importance weight.
    correction_threshold: float = 2.0
    # Lower mask threshold for MIS variants.
    correction_threshold_low: float = 0.5

    def validate(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ConfigError(f"ppo.loss_agg_mode={self.loss_agg_mode!r} not in {LOSS_AGG_MODES}")
        if self.correction_mode not in CORRECTION_MODES:
            raise ConfigError(f"ppo.correction_mode={self.correction_mode!r} not in {CORRECTION_MODES}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ConfigError(f"ppo.policy_loss={self.policy_loss!r} not in {POLICY_LOSSES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"ppo.kl_estimator={self.kl_estimator!r} not in {KL_ESTIMATORS}")
        check_positive("ppo", self, "clip_ratio_low", "clip_ratio_high", "correction_threshold")
        if self.clip_ratio_low >= 1:
            raise ConfigError(
                f"ppo.clip_ratio_low={self.clip_ratio_low} must be < 1 (the ratio is clipped below at "
                "1 - clip_ratio_low)"
            )
        check_at_least(
            "ppo", self, 0, "clip_ratio_c", "kl_coef", "kl_k3_max", "adv_eps", "correction_threshold_low"
        )
        if (
            self.correction_mode.endswith("-mis")
            and self.correction_threshold_low >= self.correction_threshold
        ):
            raise ConfigError(
                f"ppo.correction_threshold_low={self.correction_threshold_low} must be below "
                f"ppo.correction_threshold={self.correction_threshold} ({self.correction_mode})"
            )
        if self.clip_ratio_c and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"ppo.clip_ratio_c={self.clip_ratio_c} must be > 1 (or 0 to disable dual clip)")
        check_at_least("ppo", self, 1, "ppo_epochs", "num_mini_batches", "num_micro_batches")


@dataclass
class RolloutConfig:
    """Generation by the rollout engine."""

    # Engine: "embedded" (our model and KV cache) or "vllm".
    engine: str = "embedded"
    # Sampling temperature (log-probs are those of logits / temperature).
    temperature: float = 1.0
    # Nucleus sampling threshold (1.0 disables it).
    top_p: float = 1.0
    # Keep only the k most likely tokens (0 disables it).
    top_k: int = 0
    # Maximum generated tokens per response.
    max_new_tokens: int = 16
    # Synthetic response lengths for benchmarks of models that rarely sample a stop token (random weights):
    # with length_median > 0 each row's budget is drawn from a log-normal (median, length_sigma) clipped to
    # [1, max_new_tokens], from the row's sampling seed (`engine_api.protocol.row_budget`): the long tail of
    # a trained model's responses. Embedded engine, plain rows (not agent trajectories).
    length_median: int = 0
    length_sigma: float = 1.0
    # Responses sampled per prompt (the GRPO group size).
    n_samples_per_prompt: int = 8
    # Prompts per rollout batch.
    prompts_per_step: int = 16
    # Size of one weight-sync bucket in MiB.
    bucket_size_mb: int = 512
    # Tensor parallel size of the engine (vLLM, or the embedded engine of the colocated parallel loop),
    # independent of the learner's layout.
    tensor_parallel_size: int = 1
    # Expert parallel size of the embedded engine in the colocated parallel loop (carved from its replicas
    # x tensor parallel ranks, as the learner's).
    expert_parallel_size: int = 1
    # Parameter dtype inside the engine: "float32" or "bfloat16".
    dtype: str = "float32"
    # What the engine frees while the learner computes (between generation and the next weight sync):
    # 0 nothing; 1 its KV cache, and its weights moved to the host; 2 its KV cache and its weights
    # discarded (the sync sends every weight anyway). The freed and re-taken bytes are logged (engine/*).
    sleep_level: int = 0
    # Bitwise on-policy: the learner and the embedded engine run every GEMM, norm, MoE and log-softmax
    # normaliser with batch-invariant kernels (`ops.batch_invariant`), so the engine samples from logits
    # equal to the learner's training forward bit for bit and reports its log-probs (mismatch exactly 0).
    # Needs the embedded engine at the learner's tensor parallel size (rollout.tensor_parallel_size =
    # parallel.tensor_model_parallel_size; sequence parallel allowed; partial sums added in rank order),
    # context parallel 1, model.attention_backend='triton' and rollout.dtype = run.dtype; with LoRA, the
    # engine sharing the learner's base (equal expert parallel sizes, pipeline parallel 1). Slower than the
    # library GEMMs (benchmarks/bench_bitwise.py measures it). ops/README.md, "Bitwise on-policy".
    bitwise_on_policy: bool = False
    # How the embedded engine holds the expert weights: "bf16" (in rollout.dtype, as the learner sends them)
    # or "mxfp4" (the released 4-bit format: at every weight sync the bridge quantizes the learner's experts
    # into the engine's blocks and scales, `hf.mxfp4.quantize_mxfp4`; the learner trains in its own dtype,
    # and the quantization's share of the rollout/learner mismatch shows in mismatch/* and is corrected by
    # ppo.correction_mode). With model.expert_format='mxfp4' the engine holds MXFP4 experts either way.
    expert_format: str = "bf16"
    # Asynchronous rollouts (`trainer.rollout_buffer`): the learner trains on rows sampled by policies at
    # most this many versions (optimizer steps) older than its own; 0 is the synchronous loop. The engine
    # samples the batches of the next k steps ahead of the learner.
    max_staleness: int = 0
    # Partial rollouts (embedded engine): rows in flight when new weights arrive pause and continue under
    # them, each token recording the version that sampled it.
    partial: bool = False
    # With `partial`, the cache of a paused row's prefix: "keep" (as the old weights computed it) or
    # "recompute" (prefilled again with the new weights).
    partial_kv: str = "recompute"
    # Where the engines run: "colocated" (every rank hosts a learner shard and an engine shard, taking turns)
    # or "separate" (the ranks of `engine_ranks` host only embedded engines, generating while the other
    # ranks, which host only the learner, update; `trainer.separate`).
    placement: str = "colocated"
    # With placement "separate": the global ranks that host the engines (empty: the last rank).
    engine_ranks: list[int] = field(default_factory=list)
    # With placement "separate": each engine rank runs its engine in a child process it supervises (a dying
    # engine does not end the process group; needs rollout.tensor_parallel_size = expert_parallel_size = 1).
    engine_child: bool = False
    # How many times in a run an engine rank starts a new child after its engine process died (its rows in
    # flight are queued again); one more death is an EngineError.
    engine_restarts: int = 3

    def validate(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"rollout.placement={self.placement!r} not in {PLACEMENTS}")
        if self.engine not in ("embedded", "vllm"):
            raise ConfigError(f"rollout.engine={self.engine!r} not in ('embedded', 'vllm')")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        check_at_least(
            "rollout",
            self,
            1,
            "max_new_tokens",
            "n_samples_per_prompt",
            "prompts_per_step",
            "bucket_size_mb",
            "tensor_parallel_size",
            "expert_parallel_size",
        )
        check_at_least("rollout", self, 0, "top_k", "max_staleness", "engine_restarts", "length_median")
        if self.length_sigma <= 0:
            raise ConfigError(f"rollout.length_sigma must be > 0, got {self.length_sigma}")
        if self.length_median and self.engine != "embedded":
            raise ConfigError(
                f"rollout.length_median draws a budget per row, which only the embedded engine takes: got "
                f"rollout.engine={self.engine!r}"
            )
        if self.partial_kv not in ("keep", "recompute"):
            raise ConfigError(f"rollout.partial_kv={self.partial_kv!r} not in ('keep', 'recompute')")
        if self.dtype not in DTYPES:
            raise ConfigError(f"rollout.dtype={self.dtype!r} not in {DTYPES}")
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(f"rollout.sleep_level must be 0, 1 or 2, got {self.sleep_level}")
        if self.engine == "vllm" and (self.top_k or self.top_p < 1.0):
            raise ConfigError(
                "rollout.engine='vllm' returns log_softmax(logits / T) only without truncation: set "
                "rollout.top_k=0 and rollout.top_p=1.0"
            )


SFT_DATA = ("task", "conversations", "synthetic")


@dataclass
class SFTConfig:
    """Supervised next-token training (`run.mode: sft`): the loss is the token-mean negative log-likelihood of
    the response tokens over the whole step's batch."""

    # "task": the task's prompts with their reference responses (loss on the responses only);
    # "conversations": harmony conversations from `train_files` (loss on the tokens the assistant samples,
    # every assistant turn once: megatron_gptoss.data.conversations);
    # "synthetic": documents of arithmetic progressions of token ids (loss on every token; benchmarks).
    data: str = "task"
    # JSONL files of harmony conversations ("conversations").
    train_files: list[str] = field(default_factory=list)
    # Reasoning effort a conversation is rendered at when it names none ("conversations").
    reasoning_effort: str = "medium"
    # Longest rendered example kept, in tokens (0: no limit; longer ones are dropped) ("conversations").
    max_tokens: int = 4096
    # Task examples per step ("task").
    examples_per_step: int = 64
    # Tokens per packed micro-batch ("synthetic"; also the packing budget of "task" when > 0).
    token_budget: int = 0
    # Micro-batches per step per data-parallel replica ("synthetic": the step holds about this many
    # budgets of tokens per replica; "task": the rows are split into this many micro-batches).
    micro_batches: int = 1
    # 0: the loss is over the full vocabulary. N > 0: a sampled softmax (`model.sampled_softmax`): each
    # step's output layer scores the step's target tokens and N other rows drawn uniformly, their logits
    # corrected to estimate the full normaliser; the logged loss is the sampled one. For a cold start whose
    # large output layer is most of a step's work; needs tensor parallel 1. RL's log-probs are always full.
    sampled_vocab: int = 0

    def validate(self) -> None:
        if self.data not in SFT_DATA:
            raise ConfigError(f"sft.data={self.data!r} not in {SFT_DATA}")
        check_positive("sft", self, "examples_per_step", "micro_batches")
        check_at_least("sft", self, 0, "token_budget", "max_tokens", "sampled_vocab")
        if self.reasoning_effort not in ("low", "medium", "high"):
            raise ConfigError(
                f"sft.reasoning_effort={self.reasoning_effort!r} not in ('low', 'medium', 'high')"
            )
        if self.data == "synthetic" and not self.token_budget:
            raise ConfigError("sft.data='synthetic' needs sft.token_budget > 0 (tokens per micro-batch)")


# Advantage estimators that compare a sample with the other samples of its prompt (a group of one has no
# baseline).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@dataclass
class TrainConfig:
    """Everything a run needs; each component receives only its own part."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dapo: DAPOConfig = field(default_factory=DAPOConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    moe: MoEReplayConfig = field(default_factory=MoEReplayConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        self.model.validate()
        for part in (self.parallel, self.optim, self.ppo, self.rollout, self.env, self.sft, self.run):
            part.validate()
        self.data.validate()
        self.reward.validate()
        self.algorithm.validate()
        self._check_rollout_sizes()
        self.dapo.validate(self.rollout.max_new_tokens)
        self.agent.validate()
        self.moe.validate()
        if self.moe.router_replay == "r3":
            if self.rollout.engine != "embedded":
                raise ConfigError(
                    "moe.router_replay='r3' needs the engine's routing: "
                    f"rollout.engine={self.rollout.engine!r} does not return it (use the embedded engine, "
                    "or moe.router_replay='r2')"
                )
            if self.rollout.tensor_parallel_size != 1:
                raise ConfigError(
                    "moe.router_replay='r3' records routing in an engine of rollout.tensor_parallel_size=1, "
                    f"got {self.rollout.tensor_parallel_size}"
                )
        if self.rollout.bitwise_on_policy:
            self._check_bitwise()
        if self.agent.enabled and self.rollout.length_median:
            raise ConfigError(
                "rollout.length_median with agent.enabled: synthetic budgets are drawn for plain rows; a "
                "trajectory's turns share rollout.max_new_tokens (set it to 0)"
            )
        if self.agent.enabled and self.dapo.overlong_buffer:
            raise ConfigError(
                "dapo.overlong_buffer with agent.enabled: the overlong penalty is defined for one response "
                "of at most rollout.max_new_tokens, a trajectory spans several turns (set it to 0)"
            )
        if self.sft.sampled_vocab and self.parallel.tensor_model_parallel_size != 1:
            raise ConfigError(
                f"sft.sampled_vocab={self.sft.sampled_vocab} needs parallel.tensor_model_parallel_size=1 "
                "(the sampled softmax scores rows of a whole output layer; set it to 0 under tensor parallel)"
            )
        self.sandbox.validate()
        self.critic.validate()
        self.embedded.validate()
        check_rollout_expert_format(self.rollout, self.model)
        self._check_async()
        self._check_placement()
        if self.model.lora.enabled and self.algorithm.advantage == "gae":
            raise ConfigError(
                "model.lora.rank > 0 with algorithm.advantage='gae': the critic would share the frozen base "
                "and train only adapters; LoRA critics are not supported (use a critic-free advantage)"
            )
        if self.model.expert_format == "mxfp4" and not self.model.lora.enabled:
            raise ConfigError(
                "model.expert_format='mxfp4' holds the experts frozen in 4 bits, so it needs a frozen base: "
                "LoRA (model.lora.rank > 0). A full-parameter run trains the experts in the run's dtype; "
                "to generate from MXFP4 experts there, set rollout.expert_format='mxfp4' (the engine's copy)"
            )

    def _check_async(self) -> None:
        """Asynchronous rollouts: what the rollout buffer and partial rollouts cannot serve."""
        r = self.rollout
        if (r.max_staleness or r.partial) and self.dapo.dynamic_sampling:
            raise ConfigError(
                "dapo.dynamic_sampling generates extra rounds inside a step: it needs "
                "rollout.max_staleness=0 and rollout.partial=false"
            )
        if not r.partial:
            return
        needs = {
            "rollout.engine='embedded'": r.engine == "embedded",
            "embedded.schedule='continuous'": self.embedded.schedule == "continuous",
            "rollout.sleep_level=0 (a sleeping engine drops the rows in flight)": r.sleep_level == 0,
            "moe.router_replay other than 'r3' (a recomputed prefix would be recorded twice)": (
                self.moe.router_replay != "r3"
            ),
        }
        if self.agent.enabled:  # trajectories paused at tool calls keep their engine sessions
            needs["agent.sessions=true with agent.enabled"] = self.agent.sessions
            needs[
                "rollout.tensor_parallel_size=1 and rollout.expert_parallel_size=1 with agent.enabled (one "
                "engine rank per replica runs its trajectories)"
            ] = r.tensor_parallel_size == 1 and r.expert_parallel_size == 1
        missing = [need for need, met in needs.items() if not met]
        if missing:
            raise ConfigError(f"rollout.partial=true needs {'; '.join(missing)}")

    def _check_placement(self) -> None:
        """rollout.placement='separate': what the engine ranks can serve (the ranks themselves are checked
        against the world size when the run starts, `trainer.separate.placement_ranks`)."""
        r = self.rollout
        if r.placement != "separate":
            if r.engine_ranks or r.engine_child:
                raise ConfigError(
                    f"rollout.engine_ranks={r.engine_ranks} and rollout.engine_child={r.engine_child} need "
                    f"rollout.placement='separate' (got {r.placement!r})"
                )
            return
        needs = {
            "run.mode='rl' (a supervised run has no engine)": self.run.mode == "rl",
            "rollout.engine='embedded'": r.engine == "embedded",
            "rollout.sleep_level=0 (the engine ranks hold no learner to make room for)": r.sleep_level == 0,
        }
        if r.engine_child:
            needs[
                "rollout.tensor_parallel_size=1 and rollout.expert_parallel_size=1 with rollout.engine_child"
            ] = r.tensor_parallel_size == 1 and r.expert_parallel_size == 1
        missing = [need for need, met in needs.items() if not met]
        if missing:
            raise ConfigError(f"rollout.placement='separate' needs {'; '.join(missing)}")

    def _check_rollout_sizes(self) -> None:
        """Groups of one sample under a group estimator, and responses longer than the model's context."""
        group, advantage = self.rollout.n_samples_per_prompt, self.algorithm.advantage
        if self.run.mode == "rl" and advantage in GROUP_ESTIMATORS and group < 2:
            raise ConfigError(
                f"rollout.n_samples_per_prompt={group} with algorithm.advantage={advantage!r}: "
                "the advantage compares each sample with the other samples of its prompt, so it needs at "
                "least 2 (or an estimator without groups: 'reinforce_pp', 'gae')"
            )
        if self.rollout.max_new_tokens > self.model.max_position_embeddings:
            raise ConfigError(
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} exceeds the model's context, "
                f"model.max_position_embeddings={self.model.max_position_embeddings}"
            )

    def _check_bitwise(self) -> None:
        """rollout.bitwise_on_policy: both sides must run the same kernels with the same arithmetic. The
        engine's tensor-parallel size must be the learner's (a row-parallel layer's partial sums are split
        by it); LoRA needs the engine to compute with the learner's base shards and its unmerged adapters
        (`trainer.engines.shares_base`: merged weights W + scale B A round differently); context parallel
        merges partial attention rows, which no decode step does, and stays refused."""
        p, r, lora = self.parallel, self.rollout, self.model.lora.enabled
        needs = {
            "rollout.engine='embedded' (vLLM runs its own kernels)": r.engine == "embedded",
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} equal to "
            f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} (a row-parallel layer's "
            "partial sums split alike)": r.tensor_parallel_size == p.tensor_model_parallel_size,
            "parallel.context_parallel_size=1 (split attention merges partial sums in another order)": (
                p.context_parallel_size == 1
            ),
            "model.attention_backend='triton' (its decode rows equal its training rows)": (
                self.model.attention_backend == "triton"
            ),
            "rollout.dtype equal to run.dtype": r.dtype == self.run.dtype,
            "with model.lora: rollout.expert_parallel_size equal to parallel.expert_model_parallel_size and "
            "parallel.pipeline_model_parallel_size=1 (the engine then runs the learner's base shards and "
            "unmerged adapters)": not lora
            or (
                r.expert_parallel_size == p.expert_model_parallel_size
                and p.pipeline_model_parallel_size == 1
                and p.virtual_pipeline_model_parallel_size == 1
            ),
        }
        missing = [need for need, met in needs.items() if not met]
        if missing:
            raise ConfigError(f"rollout.bitwise_on_policy=true needs {'; '.join(missing)}")
