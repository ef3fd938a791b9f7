import random

import pytest
import torch

from megatron_gptoss.config import ConfigError, EnvConfig
from megatron_gptoss.envs import TASKS, ArithmeticTask, CharTokenizer, make_task


def _task(**overrides):
    task, tok = make_task(EnvConfig(**overrides))
    return task, tok


def test_registry_and_prompt_format():
    task, tok = _task()
    assert TASKS["arithmetic"] is ArithmeticTask and isinstance(tok, CharTokenizer)
    for p in task.sample_prompts(50):
        assert p.token_ids[0] == tok.bos_token_id
        assert tok.decode(p.token_ids) == "<bos>" + p.text
        a, op, b = p.text[0], p.text[1], p.text[2]
        assert p.text == f"{a}{op}{b}=" and op in "+-"
        assert p.answer == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert task.max_response_tokens == 3  # "18" or "-9", then <eos>
    with pytest.raises(ConfigError, match="env.name"):
        make_task(EnvConfig(name="chess"))


def test_correct_answer_earns_one_and_ignores_tokens_after_eos():
    task, tok = _task()
    for p in task.sample_prompts(20) + task.eval_prompts():
        ref = task.reference_response(p)
        assert task.score(p, ref) == {"reward": 1.0, "correct": True, "terminated": True, "well_formed": True}
        assert task.reward(p, ref + [5, 30, tok.pad_token_id]) == 1.0
        assert task.reward(p, torch.tensor(ref)) == 1.0


def test_partial_credit_ordering():
    task, tok = _task()
    p = next(p for p in task.eval_prompts() if 2 <= p.answer <= 4)
    ans = p.answer
    truncated = task.reward(p, tok.encode(str(ans)))  # right digits, never terminated
    empty = task.reward(p, tok.encode("<eos>"))
    malformed = task.reward(p, tok.encode("+-<eos>"))
    leading_zero = task.reward(p, tok.encode(f"0{ans}<eos>"))
    far = task.reward(p, tok.encode(f"{ans + 15}<eos>"))
    near = task.reward(p, tok.encode(f"{ans + 1}<eos>"))
    wrong_sign = task.reward(p, tok.encode(f"-{ans}<eos>"))
    correct = task.reward(p, tok.encode(f"{ans}<eos>"))
    assert truncated == 0.0
    assert empty == malformed == leading_zero == pytest.approx(0.1)
    assert far == pytest.approx(0.2)
    assert empty < far < wrong_sign < near < 0.5 < correct == 1.0
    assert task.score(p, tok.encode(f"0{ans}<eos>"))["correct"] is False
    # Out-of-vocabulary ids (a padded model vocabulary) are malformed, not an error.
    assert task.reward(p, [25, tok.eos_token_id]) == pytest.approx(0.1)
    assert task.reward(p, []) == 0.0


def test_rewards_in_unit_interval_for_random_responses():
    task, _ = _task(operators="+-*")
    g = torch.Generator().manual_seed(0)
    prompts = task.sample_prompts(200, g)
    for p, resp in zip(prompts, torch.randint(0, 32, (200, 16), generator=g)):
        s = task.score(p, resp)
        assert 0.0 <= s["reward"] <= 1.0 and s["correct"] == (s["reward"] == 1.0)


def test_no_partial_credit_is_exact_match():
    task, tok = _task(partial_credit=False)
    p = task.eval_prompts()[0]
    assert task.reward(p, task.reference_response(p)) == 1.0
    assert task.reward(p, tok.encode(f"{p.answer + 1}<eos>")) == 0.0


def test_eval_set_is_held_out_and_fixed():
    task, _ = _task()
    evals = task.eval_prompts()
    assert len(evals) == 64 and len({p.text for p in evals}) == 64
    assert task.num_train_problems == 200 - 64
    train_texts = {p.text for p in task.sample_prompts(5000)}
    assert len(train_texts) == 136  # the whole training pool shows up
    assert train_texts.isdisjoint(p.text for p in evals)
    # Independent of the stream seed; moved by eval_seed.
    assert _task(seed=7)[0].eval_prompts() == evals
    assert _task(eval_seed=1)[0].eval_prompts() != evals


def test_sampling_is_deterministic_under_seed():
    a, _ = _task(seed=3)
    b, _ = _task(seed=3)
    assert a.sample_prompts(32) == b.sample_prompts(32)
    assert a.sample_prompts(32) != a.sample_prompts(32)  # the own stream advances
    assert a.sample_prompts(16, random.Random(5)) == b.sample_prompts(16, random.Random(5))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert a.sample_prompts(16, g1) == b.sample_prompts(16, g2)


def test_multiplication_and_negative_answers():
    task, tok = _task(operators="*-", max_operand=12, eval_size=10)
    assert task.max_response_tokens == len("144") + 1
    p = next(p for p in task.sample_prompts(500) if p.answer < -9)
    assert task.reward(p, tok.encode(f"{p.answer}<eos>")) == 1.0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(operators="+/"), "env.operators"),
        (dict(operators=""), "env.operators"),
        (dict(operators="++"), "env.operators"),
        (dict(max_operand=-1), "env.max_operand"),
        (dict(eval_size=200), r"env.eval_size=200 must be in \[1, 199\]"),
        (dict(eval_size=0), "env.eval_size"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _task(**overrides)


def test_prefix_credit_rewards_the_leading_characters():
    from megatron_gptoss.config import EnvConfig
    from megatron_gptoss.envs import make_task

    task, tok = make_task(EnvConfig(closeness_credit=0.0, prefix_credit=0.6))
    prompt = next(p for p in task.eval_prompts() + task.sample_prompts(200) if p.answer >= 10)
    answer = prompt.answer_text
    eos = [tok.eos_token_id]
    full = task.reward(prompt, tok.encode(answer) + eos)
    first_only = task.reward(prompt, tok.encode(answer[0]))  # truncated after a right first digit
    first_then_eos = task.reward(prompt, tok.encode(answer[0]) + eos)
    wrong_first = task.reward(prompt, tok.encode("9" if answer[0] != "9" else "8"))
    assert full == 1.0
    assert first_only == pytest.approx(0.6 / len(answer))
    assert first_then_eos == pytest.approx(0.1 + 0.1 + 0.6 / len(answer))
    assert wrong_first == 0.0
