"""The rollout-engine boundary: sampling parameters, generations, and the `RolloutEngine` protocol."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

# An expert-range slice travels as "<HF experts tensor name>[start:stop]": rows start..stop-1 of that
# [E, ...] tensor (gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias). Only engines whose
# `accepts_expert_slices` is True are sent such names.
_SLICE = re.compile(r"^(?P<name>.+\.mlp\.experts\.[a-z_]+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


@dataclass
class SamplingParams:
    """How to sample. Returned log-probs are log_softmax(logits / temperature), before top-k/top-p."""

    # Softmax temperature (> 0).
    temperature: float = 1.0
    # Nucleus threshold; 1.0 disables it.
    top_p: float = 1.0
    # Keep the k most likely tokens; 0 disables it.
    top_k: int = 0
    # Most tokens generated per prompt.
    max_new_tokens: int = 16
    # Generation of a row ends after it samples one of these (the stop token is kept in the response).
    stop_token_ids: list[int] = field(default_factory=list)
    # Seed of the sampler: row i of a request samples from its own stream seeded by seed + i, whatever
    # rows share its batch (None: the engine's running generator).
    seed: int | None = None
    # Synthetic response lengths (0: off), for workloads of models that rarely sample a stop token (random
    # weights): row i's budget is drawn from a log-normal of this median and `length_sigma`, in [1,
    # max_new_tokens], from the row's seed (`row_budget`), so that a batch ends in a long tail as a trained
    # model's does. Engines that cannot give rows their own budgets refuse it.
    length_median: int = 0
    length_sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(
                f"top_k must be >= 0 and max_new_tokens >= 1, got {self.top_k}, {self.max_new_tokens}"
            )
        if self.length_median < 0 or self.length_sigma <= 0:
            raise ValueError(
                f"length_median must be >= 0 and length_sigma > 0, got {self.length_median}, "
                f"{self.length_sigma}"
            )


def row_budget(params: SamplingParams, row: int) -> int:
    """The token budget of row `row` of a request: `params.max_new_tokens`, or with `params.length_median`
    round(median * exp(sigma * z)) clipped to [1, max_new_tokens], z a standard normal drawn from a generator
    seeded by the row's seed (`seed + row`; the row index without a seed): the same for a row whatever the
    split of its request over engines."""
    if not params.length_median:
        return params.max_new_tokens
    stream = row if params.seed is None else params.seed + row
    z = random.Random(f"length:{stream}").gauss(0.0, 1.0)
    budget = round(params.length_median * math.exp(params.length_sigma * z))
    return max(1, min(params.max_new_tokens, budget))


@dataclass
class Generation:
    """One sampled response: its tokens, their log-probs (fp32 values as floats) and why it ended."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    # "stop" (a stop token was sampled) or "length" (max_new_tokens reached).
    finish_reason: str
    # Router replay (engines that record routing, when asked): uint8 [len(prompt_ids) + len(token_ids) - 1,
    # layers, top-k] (int16 past 255 experts), the experts each token the engine computed was routed to, in
    # sequence order: every prompt token and every response token but the last (never fed to the model).
    routing: torch.Tensor | None = None
    # The policy version (the learner's optimizer steps) of the weights that sampled each response token,
    # where the engine records it (a row continued across a weight update holds several).
    versions: list[int] | None = None


@dataclass
class SessionTurn:
    """What one session sampled since it last resumed, up to its pause."""

    session_id: int
    token_ids: list[int]
    logprobs: list[float]
    # "stop" (a stop token was sampled) or "length" (this turn's max_new_tokens reached).
    finish_reason: str
    # Router replay (when recorded): uint8 [tokens computed in this turn, layers, top-k], in sequence order
    # (the previous turn's last sampled token, any extended tokens, then this turn's samples but the last).
    routing: torch.Tensor | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from an inference engine (embedded or vLLM)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive new weights as (HF name, full tensor); the engine copies them into its own memory."""
        ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class SessionEngine(Protocol):
    """Optional capability: multi-turn trajectories that keep their KV cache across turns (tool use).

        sid = engine.open_session(prompt_ids, params, seed)    a trajectory waits to be prefilled
        turns = engine.step_sessions()                         prefill / decode every open, un-paused
            session until at least one pauses (samples a stop token or reaches its turn's
            params.max_new_tokens); one SessionTurn per session that paused in this call. Paused
            sessions stay open, their KV cache kept
        engine.extend_session(sid, token_ids, max_new_tokens)  append tokens written outside the model
            (a tool result), to be prefilled, and resume the session for max_new_tokens more
        engine.close_session(sid)                              its KV cache is freed

    Seeded sessions (`seed` set) draw the token at sequence position p (prompt included, 0-based) from
    counter p of the stream `seed`: a session extended with outside tokens samples exactly what a session
    opened on the concatenated tokens with the same seed samples.
    """

    def open_session(self, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> int: ...

    def step_sessions(self) -> list[SessionTurn]: ...

    def extend_session(self, sid: int, token_ids: list[int], max_new_tokens: int) -> None: ...

    def close_session(self, sid: int) -> None: ...


def expert_slice_name(hf_name: str, start: int, stop: int) -> str:
    """The boundary name of experts start..stop-1 of the HF experts tensor `hf_name`."""
    if not 0 <= start < stop:
        raise ValueError(f"empty or negative expert range [{start}:{stop}] of {hf_name}")
    return f"{hf_name}[{start}:{stop}]"


def parse_expert_slice(name: str) -> tuple[str, int, int] | None:
    """(HF experts tensor name, start, stop) of an expert-range slice name; None for a whole tensor."""
    m = _SLICE.match(name)
    return None if m is None else (m["name"], int(m["start"]), int(m["stop"]))
