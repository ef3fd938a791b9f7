import random

import pytest
import torch

from megatron_gptoss.config import ConfigError, EnvConfig
from megatron_gptoss.envs import TASKS, CharTokenizer, DigitTask, make_task


def _task(**overrides):
    return make_task(EnvConfig(**{"name": "reverse", **overrides}))


def test_registry_and_prompt_format():
    task, tok = _task()
    assert TASKS["reverse"] is DigitTask and TASKS["sort"] is DigitTask and isinstance(tok, CharTokenizer)
    for p in task.sample_prompts(50) + task.eval_prompts():
        assert tok.decode(p.token_ids) == "<bos>" + p.text and len(p.text) == 5 and p.text[-1] == "="
        assert p.answer == p.text[3::-1]
    assert task.max_response_tokens == 5
    sort, _ = _task(name="sort", digits=3)
    for p in sort.sample_prompts(50):
        assert p.answer == "".join(sorted(p.text[:3]))


def test_eval_set_is_held_out_fixed_and_independent_of_the_seed():
    task, _ = _task(digits=3, eval_size=100)
    evals = {p.text for p in task.eval_prompts()}
    train = {p.text for p in task.sample_prompts(20_000, random.Random(0))}  # draws every training string
    assert len(evals) == 100 and task.num_train_problems == len(train) == 900 and not evals & train
    assert len(evals | train) == 1000  # every string of three digits, leading zeros included
    assert {p.text for p in task.sample_prompts(50, torch.Generator().manual_seed(0))} <= train
    other, _ = _task(digits=3, eval_size=100, seed=7)
    assert [p.text for p in other.eval_prompts()] == [p.text for p in task.eval_prompts()]
    moved, _ = _task(digits=3, eval_size=100, eval_seed=1)
    assert {p.text for p in moved.eval_prompts()} != evals


def test_reward_exact_answer_and_digit_credit():
    task, tok = _task()
    p = next(p for p in task.eval_prompts() if len(set(p.answer)) == 4)
    ref = task.reference_response(p)
    assert ref == tok.encode(p.answer) + [tok.eos_token_id]
    assert task.score(p, ref) == {"reward": 1.0, "correct": True, "terminated": True, "digits_right": 1.0}
    assert task.reward(p, ref + [5, 30]) == 1.0 and task.reward(p, torch.tensor(ref)) == 1.0
    three = p.answer[:3] + str((int(p.answer[3]) + 1) % 10)
    assert task.reward(p, tok.encode(three + "<eos>")) == pytest.approx(0.5 * 3 / 4)
    assert task.reward(p, tok.encode(p.answer)) == pytest.approx(0.5)  # right digits, never stopped
    assert task.reward(p, tok.encode(p.answer + "1<eos>")) == pytest.approx(0.5)  # too long
    assert task.reward(p, tok.encode(p.answer[::-1] + "<eos>")) == 0.0  # the question copied
    assert task.reward(p, tok.encode("<eos>")) == 0.0 and task.reward(p, []) == 0.0
    assert task.reward(p, [31, 25, tok.eos_token_id]) == 0.0  # ids past the tokenizer: no digit, no error
    exact, _ = _task(digit_credit=0.0)
    assert exact.reward(p, tok.encode(three + "<eos>")) == 0.0 and exact.reward(p, ref) == 1.0


def test_rewards_in_unit_interval_for_random_responses():
    task, _ = _task()
    g = torch.Generator().manual_seed(0)
    for p, response in zip(task.sample_prompts(200, g), torch.randint(0, 32, (200, 6), generator=g)):
        score = task.score(p, response)
        assert 0.0 <= score["reward"] <= 1.0 and score["correct"] == (score["reward"] == 1.0)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"digits": 0}, "env.digits"),
        ({"digits": 7}, "env.digits"),
        ({"digits": 2, "eval_size": 100}, "env.eval_size"),
        ({"digit_credit": -0.1}, "digit_credit"),
    ],
)
def test_bad_config_is_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        cfg = EnvConfig(**{"name": "reverse", **overrides})
        cfg.validate()
        make_task(cfg)


def test_agent_needs_harmony_prompts():
    from megatron_gptoss.config.agent import AgentConfig

    with pytest.raises(ConfigError, match="'reverse'"):
        make_task(EnvConfig(name="reverse"), agent=AgentConfig(enabled=True))
