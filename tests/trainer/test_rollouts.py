"""DAPO's overlong penalty (against its formula) and dynamic sampling (a full batch of informative groups
when most groups are uniform, the round cap, the fallback), with a fake engine and task on a world of one."""

import random
from dataclasses import dataclass

import pytest
import torch

from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.rl.dapo import overlong_penalty, uniform_groups
from megatron_gptoss.trainer.rollouts import collect_rollouts, combine_reward_metrics

pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/trainer/conftest.py


@dataclass
class FakePrompt:
    token_ids: list[int]


class FakeTask:
    """Prompt k is one token k; a response's reward is 1 when its first token is odd, except that prompts
    divisible by `informative_every` reward a constant when `uniform_all` (every group uniform)."""

    def __init__(self, informative_every: int, uniform_all: bool = False):
        self.every, self.uniform_all = informative_every, uniform_all
        self.sampled = 0

    def sample_prompts(self, n, rng):
        self.sampled += n
        return [FakePrompt([rng.randrange(1000)]) for _ in range(n)]

    def score_batch(self, prompts, responses):
        scores = []
        for p, r in zip(prompts, responses):
            informative = p.token_ids[0] % self.every == 0 and not self.uniform_all
            reward = float(r[0] % 2) if informative else 0.5
            scores.append({"reward": reward, "correct": reward == 1.0})
        return scores, {"reward/mean": sum(s["reward"] for s in scores) / len(scores), "reward/errors": 1.0}


class FakeEngine:
    """Row i answers with tokens seeded by the request's seed + i; its length is 1 + (seed + i) % max."""

    def __init__(self, max_new_tokens):
        self.max_new_tokens, self.calls = max_new_tokens, 0

    def generate(self, prompts, params: SamplingParams):
        self.calls += 1
        out = []
        for i, prompt in enumerate(prompts):
            rng = random.Random(params.seed + i)
            n = 1 + (params.seed + i) % self.max_new_tokens
            tokens = [rng.randrange(50) for _ in range(n)]
            out.append(Generation(list(prompt), tokens, [-1.0] * n, "length"))
        return out


def _cfg(*overrides):
    base = ["rollout.prompts_per_step=6", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8"]
    return load_config(None, base + list(overrides))


def test_overlong_penalty_formula():
    lengths = torch.arange(0, 21)
    ours = overlong_penalty(lengths, 20, 8, 0.5)
    for n in range(21):
        expected = min(-(n - (20 - 8)) / 8 * 0.5, 0.0)  # DAPO: 0 up to 12 tokens, -0.5 at 20
        assert abs(float(ours[n]) - expected) <= 1e-15
    assert (
        float(ours[20]) == -0.5
        and float(ours[12]) == 0.0
        and torch.all(overlong_penalty(lengths, 20, 0, 1) == 0)
    )


def test_uniform_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, float("nan"), float("nan")])
    assert uniform_groups(rewards, 2).tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        uniform_groups(rewards, 3)


def test_dynamic_sampling_keeps_the_batch_full():
    cfg = _cfg("dapo.dynamic_sampling=true", "dapo.max_extra_rounds=50")
    task = FakeTask(informative_every=4)  # about 3 in 4 groups are uniform
    engine = FakeEngine(8)
    rollouts, metrics = collect_rollouts(cfg, engine, task, SamplingParams(max_new_tokens=8), step=3)
    rewards = torch.tensor(rollouts.rewards)
    assert len(rewards) == 6 * 4 and not uniform_groups(rewards, 4).any()  # full, all informative
    assert metrics["dapo/rounds"] == engine.calls > 1 and metrics["dapo/batch_groups"] == 6.0
    assert 0.5 < metrics["dapo/uniform_group_frac"] < 1.0
    assert metrics["reward/errors"] == float(engine.calls)  # counts add over rounds
    # the rows are whole groups: each prompt's 4 rows stand together
    ids = [p.token_ids[0] for p in rollouts.prompts]
    assert all(len(set(ids[g : g + 4])) == 1 for g in range(0, 24, 4))
    # deterministic in (step, round): the same step gives the same batch
    again, _ = collect_rollouts(cfg, FakeEngine(8), FakeTask(4), SamplingParams(max_new_tokens=8), step=3)
    assert again.rewards == rollouts.rewards and [g.token_ids for g in again.generations] == [
        g.token_ids for g in rollouts.generations
    ]


def test_dynamic_sampling_cap_and_fallback():
    cfg = _cfg("dapo.dynamic_sampling=true", "dapo.max_extra_rounds=1")
    engine = FakeEngine(8)
    rollouts, metrics = collect_rollouts(cfg, engine, FakeTask(informative_every=4), SamplingParams(), step=1)
    assert engine.calls == 2 and metrics["dapo/rounds"] == 2.0
    assert len(rollouts.rewards) == 4 * metrics["dapo/batch_groups"] <= 24
    assert not uniform_groups(torch.tensor(rollouts.rewards), 4).any()
    # no informative group at all: the first round's batch, unfiltered
    engine = FakeEngine(8)
    task = FakeTask(informative_every=4, uniform_all=True)
    rollouts, metrics = collect_rollouts(cfg, engine, task, SamplingParams(), step=1)
    assert len(rollouts.rewards) == 24 and metrics["dapo/kept_groups"] == 0.0 and engine.calls == 2
    # off: one round, every group
    engine = FakeEngine(8)
    rollouts, metrics = collect_rollouts(_cfg(), engine, FakeTask(4), SamplingParams(), step=1)
    assert engine.calls == 1 and len(rollouts.rewards) == 24 and "dapo/rounds" not in metrics


def test_overlong_penalty_enters_the_rewards():
    cfg = _cfg("dapo.overlong_buffer=4", "dapo.overlong_penalty=2.0")
    rollouts, metrics = collect_rollouts(cfg, FakeEngine(8), FakeTask(2), SamplingParams(), step=2)
    for gen, score, reward in zip(rollouts.generations, rollouts.scores, rollouts.rewards):
        n = len(gen.token_ids)
        assert reward == score["reward"] + min(-(n - 4) / 4 * 2.0, 0.0)
    lengths = [len(g.token_ids) for g in rollouts.generations]
    assert metrics["dapo/overlong_frac"] == sum(n > 4 for n in lengths) / len(lengths) > 0


def test_combine_reward_metrics_and_config():
    combined = combine_reward_metrics(
        [(4, {"reward/mean": 1.0, "reward/errors": 2.0}), (12, {"reward/mean": 0.0})]
    )
    assert combined == {"reward/mean": 0.25, "reward/errors": 2.0}
    with pytest.raises(ConfigError, match="dapo.overlong_buffer=9 must be in"):
        _cfg("dapo.overlong_buffer=9")
    with pytest.raises(ConfigError, match="dapo.max_extra_rounds"):
        _cfg("dapo.max_extra_rounds=-1")
