"""Model configuration: the GPT-OSS architecture, its presets and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_gptoss.config.lora import LoRAConfig
from megatron_gptoss.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "eager", "flex", "triton", "fa4")
EXPERT_BACKENDS = ("auto", "grouped_mm", "loop")
EXPERT_FORMATS = ("bf16", "mxfp4")
# `ops.mxfp4_bytes.HELD_FORMATS`: the formats a model's MXFP4 weights may be held in
MXFP4_BYTE_FORMATS = ("checkpoint", "pairs", "tiled_pairs")
# Values per MXFP4 block and bits per stored value (4-bit codes plus one 8-bit scale per 32 values).
MXFP4_BLOCK = 32
MXFP4_TILE = 64  # "tiled_pairs": rows and inputs of a stored tile (`ops.mxfp4_bytes.TILE_ROWS`, `TILE_K`)
MXFP4_BITS = 4.25


@dataclass
class ModelConfig:
    """Architecture of a GPT-OSS model. Field names follow Megatron; `to_hf_config` maps them to HF."""

    # Real vocabulary size (tokens the tokenizer can produce); the embedding is padded beyond it.
    vocab_size: int = 201088
    # Pad the embedding/output rows to a multiple of this times the tensor-parallel size (Megatron style).
    make_vocab_size_divisible_by: int = 128
    # Width of the residual stream.
    hidden_size: int = 2880
    # Width of one expert's SwiGLU (fc1 produces 2x this: gate and up).
    intermediate_size: int = 2880
    # Number of transformer layers.
    num_layers: int = 24
    # Query heads per layer.
    num_attention_heads: int = 64
    # Key/value heads per layer (GQA groups).
    num_query_groups: int = 8
    # Width of one attention head.
    head_dim: int = 64
    # Keys a sliding-window layer sees, the query itself included (query i sees i - W < j <= i).
    sliding_window: int = 128
    # Layer kinds, "sliding" or "full"; empty means GPT-OSS's alternation (even layers sliding).
    layer_types: list[str] = field(default_factory=list)
    # Number of routed experts per layer.
    num_experts: int = 32
    # Experts each token is routed to.
    moe_router_topk: int = 4
    # Compute the router matmul in fp32 instead of the parameter dtype (HF and vLLM use the parameter dtype).
    moe_router_fp32: bool = False
    # SwiGLU clamp: gate clamped above and up clamped to [-limit, limit].
    swiglu_limit: float = 7.0
    # SwiGLU sigmoid slope: glu = gate * sigmoid(alpha * gate).
    swiglu_alpha: float = 1.702
    # Biases on QKV, output projection, router and experts.
    add_bias_linear: bool = True
    # RMSNorm epsilon.
    norm_epsilon: float = 1e-5
    # RoPE base.
    rotary_base: float = 150000.0
    # YaRN context-extension factor (1.0 disables YaRN).
    yarn_factor: float = 32.0
    # YaRN ramp boundaries in rotations.
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # Context length the base RoPE was trained for.
    yarn_original_max_position_embeddings: int = 4096
    # Round the YaRN correction range to whole dimensions (GPT-OSS: False).
    yarn_truncate: bool = False
    # Longest context the model is used with.
    max_position_embeddings: int = 131072
    # Standard deviation of the random initialisation.
    init_std: float = 0.02
    # The routers' and the output layer's standard deviations (None: init_std). Larger values give peaked
    # routing and logits from random weights, as trained models have.
    router_init_std: float | None = None
    output_init_std: float | None = None
    # Attention implementation: auto picks fa4, then triton on CUDA, eager elsewhere.
    attention_backend: str = "auto"
    # Expert GEMM implementation: auto uses torch._grouped_mm where it runs, else a loop over experts.
    expert_backend: str = "auto"
    # How the experts' fc1 / fc2 weights are held: "bf16" (parameters in the run's dtype) or "mxfp4" (frozen
    # uint8 blocks and scales as the released checkpoints store them, 4.25 bits a value; biases, router and
    # every non-expert weight stay in the run's dtype). The learner needs a frozen base for mxfp4 (LoRA).
    expert_format: str = "bf16"
    # How MXFP4 expert weights (the learner's with expert_format mxfp4, or a rollout engine's) hold their
    # bytes in memory: "checkpoint" as the released checkpoints store them, or "pairs"
    # (`ops.mxfp4_bytes.pair_words`: each block as four 32-bit words that decode into bf16 pairs with a shift,
    # a mask and one multiply, about half the decode kernels' instructions; scale bytes 2..128 only, i.e.
    # weights up to 12 in magnitude), or "tiled_pairs" (the pairs stored tile by tile, 64 rows by 64 inputs a
    # tile, so that the decode kernels read a tile as one contiguous run; hidden_size and intermediate_size
    # multiples of 64). Run checkpoints and exports hold the released bytes either way.
    mxfp4_byte_format: str = "checkpoint"
    # Recompute each layer's activations in the backward pass.
    activation_checkpointing: bool = False
    # Special token ids written into the HF config.
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # LoRA adapters on a frozen base (rank 0: off).
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # a config read back from a manifest (dataclasses.asdict)
            self.lora = LoRAConfig(**self.lora)
        if not self.layer_types:
            self.layer_types = ["sliding" if i % 2 == 0 else "full" for i in range(self.num_layers)]
        self.validate()

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "num_experts",
            "moe_router_topk",
            "sliding_window",
            "make_vocab_size_divisible_by",
            "max_position_embeddings",
            "yarn_original_max_position_embeddings",
            "norm_epsilon",
            "rotary_base",
            "swiglu_limit",
            "swiglu_alpha",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        for name in ("init_std", "router_init_std", "output_init_std"):
            std = getattr(self, name)
            if std is not None and not std >= 0:
                raise ConfigError(f"model.{name} must be >= 0, got {std}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token = getattr(self, name)
            if token is not None and not 0 <= token < self.vocab_size:
                raise ConfigError(f"model.{name}={token} is outside the vocabulary [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.num_query_groups}"
            )
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(
                f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts={self.num_experts}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"model.layer_types has {len(self.layer_types)} entries, model.num_layers={self.num_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in ("sliding", "full")})
        if bad:
            raise ConfigError(f"model.layer_types has unknown kinds {bad}; use 'sliding' or 'full'")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"model.attention_backend={self.attention_backend!r} not in {ATTENTION_BACKENDS}"
            )
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ConfigError(f"model.expert_backend={self.expert_backend!r} not in {EXPERT_BACKENDS}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(f"model.expert_format={self.expert_format!r} not in {EXPERT_FORMATS}")
        if self.mxfp4_byte_format not in MXFP4_BYTE_FORMATS:
            raise ConfigError(
                f"model.mxfp4_byte_format={self.mxfp4_byte_format!r} not in {MXFP4_BYTE_FORMATS}"
            )
        if self.mxfp4_byte_format == "tiled_pairs":
            for name in ("hidden_size", "intermediate_size"):  # the experts' widths, in and out
                if getattr(self, name) % MXFP4_TILE:
                    raise ConfigError(
                        f"model.mxfp4_byte_format='tiled_pairs' stores {MXFP4_TILE} x {MXFP4_TILE} tiles: "
                        f"model.{name}={getattr(self, name)} is not a multiple of {MXFP4_TILE} (use 'pairs')"
                    )
        if self.expert_format == "mxfp4":
            for name in ("hidden_size", "intermediate_size"):  # the experts' input widths
                if getattr(self, name) % MXFP4_BLOCK:
                    raise ConfigError(
                        f"model.expert_format='mxfp4' quantizes the experts' inputs in blocks of "
                        f"{MXFP4_BLOCK}: model.{name}={getattr(self, name)} is not a multiple of it"
                    )
        if self.yarn_factor < 1.0:
            raise ConfigError(f"model.yarn_factor={self.yarn_factor} must be >= 1")
        self.lora.validate()

    # ----------------------------------------------------------------------------------------------
    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        """Vocabulary rows of the embedding and output layer: a multiple of 128 x tp."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def init_std_of(self, name: str) -> float:
        """The initialisation scale of the parameter `name` (a GPTOSSModel parameter name)."""
        if ".router." in name and self.router_init_std is not None:
            return self.router_init_std
        if name.startswith("output_layer.") and self.output_init_std is not None:
            return self.output_init_std
        return self.init_std

    def window_of(self, layer: int) -> int | None:
        """Sliding window of a layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    def param_counts(self) -> dict[str, int]:
        """Total and active parameters (HF shapes, unpadded vocab). Active counts the unembedding,
        not the embedding, and top-k of the experts (OpenAI's convention). `expert_weights`: the values of
        every expert's fc1 and fc2 weights (biases excluded), the part MXFP4 stores."""
        h, i, e, d = self.hidden_size, self.intermediate_size, self.num_experts, self.head_dim
        q, kv = self.num_attention_heads, self.num_query_groups
        bias = 1 if self.add_bias_linear else 0
        attn = h * (q + 2 * kv) * d + bias * (q + 2 * kv) * d + q * d * h + bias * h + q + h
        router = e * h + bias * e
        expert = 2 * i * h + bias * 2 * i + i * h + bias * h
        norm = h
        per_layer_dense = attn + router + norm
        embed = self.vocab_size * h
        unembed = self.vocab_size * h
        total = self.num_layers * (per_layer_dense + e * expert) + embed + unembed + h
        active = self.num_layers * (per_layer_dense + self.moe_router_topk * expert) + unembed + h
        expert_weights = self.num_layers * e * 3 * i * h  # fc1 [2I, H] and fc2 [H, I] of every expert
        return {"total": total, "active": active, "embedding": embed, "expert_weights": expert_weights}

    def weight_bytes(self, dtype_bytes: int) -> float:
        """Bytes of the model's weights (HF shapes) with every value in `dtype_bytes` bytes, except the expert
        fc1 / fc2 weights at 4.25 bits a value when `expert_format` is mxfp4."""
        counts = self.param_counts()
        if self.expert_format != "mxfp4":
            return counts["total"] * dtype_bytes
        experts = counts["expert_weights"]
        return (counts["total"] - experts) * dtype_bytes + experts * MXFP4_BITS / 8

    def to_hf_config(self) -> dict:
        """The config.json of the equivalent HF GptOssForCausalLM."""
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "layer_types": [f"{t}_attention" for t in self.layer_types],
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.moe_router_topk,
            "experts_per_token": self.moe_router_topk,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
            "attention_bias": self.add_bias_linear,
            "rms_norm_eps": self.norm_epsilon,
            "rope_theta": self.rotary_base,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": self.yarn_factor,
                "beta_fast": self.yarn_beta_fast,
                "beta_slow": self.yarn_beta_slow,
                "truncate": self.yarn_truncate,
                "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.init_std,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, hf: dict, **overrides) -> ModelConfig:
        """Build from an HF config.json dict (either `rope_scaling` or `rope_parameters` spelling)."""
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        types = hf.get("layer_types") or []
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_query_groups=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            sliding_window=hf.get("sliding_window") or 128,
            layer_types=[t.replace("_attention", "") for t in types],
            num_experts=hf["num_local_experts"],
            moe_router_topk=hf.get("num_experts_per_tok", hf.get("experts_per_token", 4)),
            swiglu_limit=hf.get("swiglu_limit", 7.0),
            swiglu_alpha=hf.get("swiglu_alpha", 1.702),
            add_bias_linear=hf.get("attention_bias", True),
            norm_epsilon=hf.get("rms_norm_eps", 1e-5),
            rotary_base=hf.get("rope_theta", rope.get("rope_theta", 150000.0)),
            yarn_factor=rope.get("factor", 1.0) if rope.get("rope_type", "yarn") == "yarn" else 1.0,
            yarn_beta_fast=rope.get("beta_fast", 32.0),
            yarn_beta_slow=rope.get("beta_slow", 1.0),
            yarn_truncate=rope.get("truncate", True),
            yarn_original_max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
            max_position_embeddings=hf.get("max_position_embeddings", 131072),
            init_std=hf.get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_first(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


def _first(value):
    return value[0] if isinstance(value, list) else value


# -------------------------------------------------------------------------------------------------
# Presets
def gpt_oss_20b(**overrides) -> ModelConfig:
    """gpt-oss-20b: 24 layers, 32 experts (20.9B total, 3.6B active)."""
    return ModelConfig(**{"num_layers": 24, "num_experts": 32, **overrides})


def gpt_oss_120b(**overrides) -> ModelConfig:
    """gpt-oss-120b: 36 layers, 128 experts (116.8B total, 5.1B active)."""
    return ModelConfig(**{"num_layers": 36, "num_experts": 128, **overrides})


def gpt_oss_tiny(**overrides) -> ModelConfig:
    """Test-sized GPT-OSS with every feature: GQA 2:1, sinks, sliding/full alternation (window 8,
    shorter than test sequences), YaRN, top-2 of 4 experts, biases."""
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        sliding_window=8,
        num_experts=4,
        moe_router_topk=2,
        yarn_original_max_position_embeddings=64,
        max_position_embeddings=2048,
        make_vocab_size_divisible_by=32,
        attention_backend="eager",  # the reference backend: tests pick others explicitly
    )
    return ModelConfig(**{**base, **overrides})


def gpt_oss_demo(**overrides) -> ModelConfig:
    """The CPU demo model: small enough to RL-train on two cores in minutes, GPT-OSS-shaped."""
    base = dict(
        vocab_size=32,
        hidden_size=128,
        intermediate_size=128,
        num_layers=4,
        num_attention_heads=8,
        num_query_groups=2,
        head_dim=16,
        sliding_window=16,
        num_experts=8,
        moe_router_topk=2,
        yarn_original_max_position_embeddings=64,
        max_position_embeddings=1024,
        make_vocab_size_divisible_by=32,
        attention_backend="eager",  # fastest on the CPU
    )
    return ModelConfig(**{**base, **overrides})


MODEL_PRESETS = {
    "gpt_oss_20b": gpt_oss_20b,
    "gpt_oss_120b": gpt_oss_120b,
    "gpt_oss_tiny": gpt_oss_tiny,
    "gpt_oss_demo": gpt_oss_demo,
}
