"""The multi-turn agent loop: many trajectories in flight, each generating until a tool call or a final
answer, its calls run on the `ToolExecutor` while the other trajectories keep generating.

    prompt ──open_session──> generate ──<|return|>──> final
                                │ <|call|>
                                v
            parse_tool_call ─> ToolExecutor.submit ─> (other rows keep generating) ─> outcome
                                │ tool_result_tokens (tool tokens: source tool, log-prob 0)
                                v
                   extend_session(result tokens) ──> generate ...   until a final answer, agent.max_turns
                                                                    or agent.max_total_tokens

An engine with the `SessionEngine` capability keeps each trajectory's KV cache between turns and prefills
only the appended tool tokens. Any other engine is asked to `generate` from the whole trajectory again at
every turn (what vLLM's prefix caching serves without recomputation).

Router replay: where the engine records routing, a trajectory keeps, turn by turn, the experts of the tokens
the turn computed first (a session's turn: the previous turn's last sampled token, the tool tokens, this
turn's samples but the last; re-generating: the same rows of the turn's whole-trajectory record). Together
they are one row per input token of the trajectory's training row (prompt + response but the last token),
whichever way the trajectory ended. With sessions every token is computed once, so these are exactly the
experts behind every engine log-prob; re-generating, a later turn routes the re-read prefix anew, which
matches the first record only where the engine's prefill routes as its decode did.

A trajectory ends with one of FINISH_REASONS:
  "final"             the model sampled a final-answer token (`<|return|>`)
  "max_turns"         it called a tool in its last allowed turn (agent.max_turns assistant turns)
  "max_total_tokens"  prompt + response reached agent.max_total_tokens, or a tool result would pass it
  "length"            a turn reached the sampling params' max_new_tokens without a stop token
  "unanswerable"      it ended with `<|call|>` but named no recipient (there is no tool to answer)
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from megatron_gptoss.agent.calls import ToolCall, ToolOutcome, parse_tool_call, tool_result_tokens
from megatron_gptoss.agent.executor import ToolExecutor
from megatron_gptoss.agent.lockstep import LockstepExecutor
from megatron_gptoss.config.agent import AgentConfig
from megatron_gptoss.engine_api import Generation, RolloutEngine, SamplingParams, SessionEngine
from megatron_gptoss.errors import EngineError
from megatron_gptoss.harmony import CALL, RETURN

MODEL, TOOL = 1, 0  # per-token sources: written by the model (trained) / by a tool (out of the loss)
FINISH_REASONS = ("final", "max_turns", "max_total_tokens", "length", "unanswerable")
_SEED_STRIDE = (
    1_000_003  # re-generation without sessions: turn k of a seeded request samples from seed + k*stride
)


@dataclass(frozen=True)
class CallFormat:
    """How tool calls appear in the token stream: the tokens ending a call and a final answer, the parser
    of a turn ending in a call, and the tokens answering it. `HARMONY` is GPT-OSS's."""

    call_tokens: frozenset[int]
    final_tokens: frozenset[int]
    parse: Callable[[Sequence[int]], ToolCall | None]
    result_tokens: Callable[[Sequence[int], ToolCall, ToolOutcome], list[int]]

    @property
    def stop_token_ids(self) -> list[int]:
        return sorted(self.call_tokens | self.final_tokens)


HARMONY = CallFormat(frozenset({CALL}), frozenset({RETURN}), parse_tool_call, tool_result_tokens)


@dataclass
class Trajectory:
    """One agentic rollout. `token_ids` is the response (everything after the prompt, model and tool tokens
    in order); `sources[i]` is MODEL or TOOL (so it is also the response's loss mask); `logprobs[i]` the
    engine's log-prob of a model token, 0.0 for a tool token. `routing` (engines recording it): per turn, the
    experts [tokens the turn computed first, layers, k] of its tokens, in sequence order. `versions` (a
    `SessionRun`'s, empty otherwise): the policy version that sampled each model token; a tool token carries
    the version of the turn whose call it answers."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    routing: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def response_mask(self) -> list[int]:
        """1 on model tokens, 0 on tool tokens: `rl.batch.build_batch`'s `response_masks` row."""
        return list(self.sources)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def append(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        version: int | Sequence[int] | None = None,
    ) -> None:
        """Model tokens with their log-probs, or tool tokens (logprobs None); `version` recorded for each
        where given (one for all, or the engine's record of each)."""
        if isinstance(version, int):
            self.versions += [version] * len(token_ids)
        elif version is not None:
            self.versions += list(version)
        self.token_ids += token_ids
        self.sources += [MODEL if logprobs is not None else TOOL] * len(token_ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(token_ids)

    @property
    def routed(self) -> int:
        """Tokens whose experts the routing record holds."""
        return sum(r.shape[0] for r in self.routing)

    def add_routing(self, routing: torch.Tensor | None) -> None:
        """A turn's routing record, after its tokens were appended: afterwards every token but the last
        (never fed to the model) has its experts. An engine recording nothing leaves it empty."""
        if routing is None and not self.routing:
            return
        if routing is not None:
            self.routing.append(routing)
        if self.routed != len(self) - 1:
            raise EngineError(
                f"routing record of {self.routed} tokens after turn {self.turns}, for a trajectory of "
                f"{len(self)} tokens (expected {len(self) - 1}: every token but the last)"
            )

    def generation(self) -> AgentGeneration:
        """The trajectory as the trainer's rollouts hold it."""
        return AgentGeneration(
            list(self.prompt_ids),
            list(self.token_ids),
            list(self.logprobs),
            self.finish_reason,
            sources=list(self.sources),
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_timeouts=self.tool_timeouts,
            routing=torch.cat(self.routing) if self.routing else None,
            versions=list(self.versions) if self.versions else None,
        )


@dataclass
class AgentGeneration(Generation):
    """A trajectory as a `Generation`: `token_ids` / `logprobs` span every turn (0.0 on tool tokens),
    `finish_reason` is one of FINISH_REASONS, `sources` marks each response token MODEL or TOOL, `routing`
    (when the engine records it) every turn's record in sequence order: [len(prompt_ids) + len(token_ids)
    - 1, layers, k], as a single-turn `Generation`'s."""

    sources: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


def agent_metrics(
    trajectories: Sequence[Trajectory | AgentGeneration], rewards: Sequence[float] | None = None
) -> dict:
    """Flat numbers for the step's log: turns and tool calls per trajectory, the fraction that called a
    tool, tool errors and timeouts, tokens by source, finish reasons, and the mean reward by number of
    turns when rewards are given."""
    n = max(len(trajectories), 1)
    out: dict[str, float] = {
        "agent/call_rate": sum(t.tool_calls > 0 for t in trajectories) / n,
        "agent/turns_mean": sum(t.turns for t in trajectories) / n,
        "agent/turns_max": max((t.turns for t in trajectories), default=0),
        "agent/tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "agent/tool_errors": sum(t.tool_errors for t in trajectories),
        "agent/tool_timeouts": sum(t.tool_timeouts for t in trajectories),
        "agent/tokens_model": sum(sum(t.sources) for t in trajectories),
        "agent/tokens_tool": sum(len(t.sources) - sum(t.sources) for t in trajectories),
    }
    for reason in FINISH_REASONS:
        out[f"agent/finish_{reason}"] = sum(t.finish_reason == reason for t in trajectories)
    if rewards is not None:
        by_turns: dict[int, list[float]] = {}
        for t, r in zip(trajectories, rewards, strict=True):
            by_turns.setdefault(t.turns, []).append(r)
        for turns, rs in sorted(by_turns.items()):
            out[f"agent/reward_turns_{turns}"] = sum(rs) / len(rs)
    return out


class AgentLoop:
    """Runs `rollout(prompts)`: one Trajectory per prompt. `params.max_new_tokens` bounds one turn,
    `agent.max_total_tokens` the whole trajectory, `agent.max_turns` its assistant turns; the params'
    stop tokens are replaced by the format's. Seeded params: with sessions, prompt i samples from the
    stream `params.seed + i` in every turn, however the engine schedules it; re-generating, each request's
    rows get seeds from a seed of its own, so which rows share a round (whose calls have answered) decides
    what they sample, unless `agent.wait_for_tools` makes every round wait for all pending calls."""

    def __init__(
        self,
        engine: RolloutEngine | SessionEngine,
        executor: ToolExecutor | LockstepExecutor,
        params: SamplingParams,
        agent: AgentConfig,
        call_format: CallFormat = HARMONY,
        *,
        use_sessions: bool | None = None,
    ):
        self.engine = engine
        self.executor = executor
        self.params = replace(params, stop_token_ids=call_format.stop_token_ids)
        self.agent = agent
        self.format = call_format
        self.use_sessions = isinstance(engine, SessionEngine) if use_sessions is None else use_sessions

    def rollout(self, prompts: Sequence[Sequence[int]]) -> list[Trajectory]:
        trajs = self._trajectories(prompts)
        if self.use_sessions:
            self._rollout_sessions(trajs)
        else:
            self._rollout_regenerate(trajs)
        return trajs

    def begin(self, prompts: Sequence[Sequence[int]], version: int | None = None) -> SessionRun:
        """The prompts' trajectories as a `SessionRun` (sessions engine), nothing stepped yet; `version`: the
        engine's policy version now."""
        if not self.use_sessions:
            raise ValueError("a SessionRun needs an engine with sessions (use_sessions)")
        return SessionRun(self, self._trajectories(prompts), version)

    def _trajectories(self, prompts: Sequence[Sequence[int]]) -> list[Trajectory]:
        trajs = [Trajectory(list(p)) for p in prompts]
        for i, t in enumerate(trajs):
            if len(t) >= self.agent.max_total_tokens:
                raise ValueError(
                    f"prompt {i} has {len(t)} tokens, agent.max_total_tokens={self.agent.max_total_tokens}"
                )
        return trajs

    def _budget(self, traj: Trajectory) -> int:
        return min(self.params.max_new_tokens, self.agent.max_total_tokens - len(traj))

    def _seed(self, i: int, turn: int = 0) -> int | None:
        return None if self.params.seed is None else self.params.seed + i + turn * _SEED_STRIDE

    def _end_turn(
        self,
        traj: Trajectory,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: str,
        routing: torch.Tensor | None,
        version: int | Sequence[int] | None = None,
    ) -> tuple[concurrent.futures.Future, ToolCall] | None:
        """Record a turn (`routing`: the experts of the tokens it computed first, or None; `version`: the
        policy that sampled it, recorded where given); its tool call and the call's future when the
        trajectory goes on, else None (it ended)."""
        traj.append(token_ids, logprobs, version)
        traj.turns += 1
        traj.add_routing(routing)
        last = token_ids[-1] if token_ids else None
        if finish_reason == "stop" and last in self.format.final_tokens:
            traj.finish_reason = "final"
        elif finish_reason == "stop" and last in self.format.call_tokens:
            call = self.format.parse(token_ids)
            if call is None:
                traj.finish_reason = "unanswerable"
            elif traj.turns >= self.agent.max_turns:
                traj.finish_reason = "max_turns"
            else:
                traj.tool_calls += 1
                return self.executor.submit(call), call
        elif len(traj) >= self.agent.max_total_tokens:
            traj.finish_reason = "max_total_tokens"
        else:
            traj.finish_reason = "length"
        return None

    def _answer(
        self, traj: Trajectory, future: concurrent.futures.Future, call: ToolCall
    ) -> list[int] | None:
        """The tool tokens appended to the trajectory (None when they would pass max_total_tokens: it
        ends). A ToolError (the sandbox cannot run) propagates."""
        outcome: ToolOutcome = future.result()
        traj.tool_errors += outcome.status == "error"
        traj.tool_timeouts += outcome.status == "timeout"
        full = traj.prompt_ids + traj.token_ids
        tokens = self.format.result_tokens(full, call, outcome)
        if len(traj) + len(tokens) >= self.agent.max_total_tokens:
            traj.finish_reason = "max_total_tokens"
            return None
        traj.append(tokens, None, traj.versions[-1] if traj.versions else None)
        return tokens

    def _rollout_sessions(self, trajs: list[Trajectory]) -> None:
        SessionRun(self, trajs).finish()

    def _rollout_regenerate(self, trajs: list[Trajectory]) -> None:
        engine = self.engine
        generating = list(range(len(trajs)))
        waiting: dict[concurrent.futures.Future, tuple[int, ToolCall]] = {}
        rounds = 0
        while generating or waiting:
            everyone = self.agent.wait_for_tools
            for future in self.executor.done(list(waiting), wait=not generating, wait_all=everyone):
                i, call = waiting.pop(future)
                if self._answer(trajs[i], future, call) is not None:
                    generating.append(i)
            if not generating:
                continue
            by_budget: dict[int, list[int]] = {}
            for i in sorted(generating):
                by_budget.setdefault(self._budget(trajs[i]), []).append(i)
            generating = []
            for budget, rows in by_budget.items():
                seed = None if self.params.seed is None else self.params.seed + rounds * _SEED_STRIDE
                params = replace(self.params, max_new_tokens=budget, seed=seed)
                gens = engine.generate(  # type: ignore[union-attr]
                    [trajs[i].prompt_ids + trajs[i].token_ids for i in rows], params
                )
                for i, gen in zip(rows, gens, strict=True):
                    routing = None if gen.routing is None else gen.routing[trajs[i].routed :]
                    pending = self._end_turn(  # the engine's record of each token's policy version
                        trajs[i], gen.token_ids, gen.logprobs, gen.finish_reason, routing, gen.versions
                    )
                    if pending is not None:
                        waiting[pending[0]] = (i, pending[1])
            rounds += 1


class SessionRun:
    """One request's trajectories over a session engine, run in parts (partial rollouts):

        advance   open the sessions (first call) and step them until each has ended or waits on a tool
                  call; answers are not taken (which turn a policy samples does not depend on tool timing)
        weights_changed(version, recompute)
                  the engine holds new weights: later turns record `version`; a trajectory waiting on a
                  tool keeps its session (the prefix's cache as the old weights computed it) or, with
                  `recompute`, has it closed, to be opened again over the whole trajectory when the answer
                  comes (the same seed: position p still samples from counter p of it)
        finish    every trajectory to its end (the tools' answers, then the turns after them); the sessions
                  closed; the trajectories

    Every model token records the run's `version` when it was sampled (None: no versions). Sessions open
    at the first `advance` or `finish`: runs over one engine must be stepped one at a time (a turn of
    another run's session is an EngineError), so no turn spans a change of weights."""

    def __init__(self, loop: AgentLoop, trajs: list[Trajectory], version: int | None = None):
        assert isinstance(loop.engine, SessionEngine)
        self.loop, self.engine, self.trajs, self.version = loop, loop.engine, trajs, version
        self.session: dict[int, int] = {}  # trajectory -> its open session
        self.generating: set[int] = set()  # sessions sampling a turn
        self.waiting: dict[concurrent.futures.Future, tuple[int, ToolCall]] = {}  # -> (trajectory, call)
        self.reopen: set[int] = set()  # trajectories whose session was closed to be computed again
        self.opened = False

    def _open(self) -> None:
        if self.opened:
            return
        self.opened = True
        for i, t in enumerate(self.trajs):
            params = replace(self.loop.params, max_new_tokens=self.loop._budget(t))
            self.session[i] = self.engine.open_session(t.prompt_ids, params, self.loop._seed(i))
        self.generating = set(self.session.values())

    def _resume(self, i: int, tokens: list[int]) -> None:
        """Trajectory i goes on after the tool tokens `tokens` (appended to it already)."""
        traj, budget = self.trajs[i], self.loop._budget(self.trajs[i])
        if i in self.reopen:
            self.reopen.discard(i)
            params = replace(self.loop.params, max_new_tokens=budget)
            self.session[i] = self.engine.open_session(
                traj.prompt_ids + traj.token_ids, params, self.loop._seed(i)
            )
        else:
            self.engine.extend_session(self.session[i], tokens, budget)
        self.generating.add(self.session[i])

    def _step(self) -> None:
        owner = {sid: i for i, sid in self.session.items()}
        for turn in self.engine.step_sessions():
            if turn.session_id not in owner:
                raise EngineError(f"session {turn.session_id} belongs to another run stepping on this engine")
            self.generating.discard(turn.session_id)
            i = owner[turn.session_id]
            pending = self.loop._end_turn(
                self.trajs[i], turn.token_ids, turn.logprobs, turn.finish_reason, turn.routing, self.version
            )
            if pending is not None:
                self.waiting[pending[0]] = (i, pending[1])

    def advance(self) -> None:
        try:
            self._open()
            while self.generating:
                self._step()
        except BaseException:
            self.close()
            raise

    def weights_changed(self, version: int, recompute: bool) -> None:
        if self.generating:
            raise EngineError("new weights while a turn is sampled: advance the run first")
        self.version = version
        if recompute:
            for i, _ in self.waiting.values():
                self.engine.close_session(self.session.pop(i))
                self.reopen.add(i)

    def finish(self) -> list[Trajectory]:
        try:
            self._open()
            while self.generating or self.waiting:
                # every live trajectory waiting on a tool: wait for the first answer
                for future in self.loop.executor.done(list(self.waiting), wait=not self.generating):
                    i, call = self.waiting.pop(future)
                    tokens = self.loop._answer(self.trajs[i], future, call)
                    if tokens is not None:
                        self._resume(i, tokens)
                if self.generating:
                    self._step()
        finally:
            self.close()
        return self.trajs

    def close(self) -> None:
        """Close every open session (their unreturned turns dropped)."""
        for sid in self.session.values():
            self.engine.close_session(sid)
        self.session, self.generating = {}, set()
