import time
from fractions import Fraction

import pytest
from helpers.reward_rows import completion, gsm8k_row

from megatron_gptoss.rewards import gsm8k_reward, model_answer, reference_answer
from megatron_gptoss.rewards.numbers import MAX_DIGITS, parse_number


def score(final, answer="18", **kw):
    return gsm8k_reward(completion(final, **kw), gsm8k_row(answer))


@pytest.mark.parametrize(
    "text, value",
    [
        ("The answer is 18.", 18),
        ("$1,234", 1234),
        ("She has 12 apples", 12),
        ("It costs 3.50 dollars", Fraction(7, 2)),
        ("0.5", Fraction(1, 2)),
        ("1/2", Fraction(1, 2)),
        ("1/2.", Fraction(1, 2)),
        ("1 / 2 of it", Fraction(1, 2)),
        (".25", Fraction(1, 4)),
        ("50%", 50),  # a percent sign is a unit: 50% is 50
        ("-3", -3),
        ("\u22123", -3),  # the Unicode minus sign
        ("\uff0d3", -3),  # fullwidth hyphen-minus
        ("5-3", 3),  # a minus glued to a digit is not a sign
        ("\uff11\uff12\uff13", 123),  # fullwidth digits
        ("\u0661\u0662\u066c\u0663\u0664\u0665", 12345),  # Arabic-Indic digits and thousands separator
        ("\u0968\u096a", 24),  # Devanagari digits
        ("1,2,3", 3),  # a list, not a thousands-separated number
        ("12 m\u00b2", 12),  # a superscript is not a digit
        ("first 7, then 8, finally 9", 9),
    ],
)
def test_last_number(text, value):
    assert model_answer(text) == (Fraction(value), "last_number")


@pytest.mark.parametrize(
    "text, value",
    [
        ("so \\boxed{18} apples, 20 in all", 18),  # boxed wins over the last number
        ("\\boxed{1{,}234}", 1234),
        ("\\boxed{\\frac{1}{2}}", Fraction(1, 2)),
        ("\\boxed{\\dfrac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{\\$18.00}", 18),
        ("\\boxed{x = 4} then \\boxed{5}", 5),  # the last box
        ("\\boxed{18 \\text{ dollars}}", 18),
    ],
)
def test_boxed(text, value):
    assert model_answer(text) == (Fraction(value), "boxed")


def test_unreadable_answers():
    assert model_answer("no digits here") == (None, "no_number")
    assert model_answer("\\boxed{x} but 18") == (None, "boxed_not_a_number")
    assert model_answer("1/0") == (None, "unreadable_number")
    assert model_answer("9" * (MAX_DIGITS + 1)) == (None, "unreadable_number")
    assert model_answer("9" * MAX_DIGITS) == (Fraction("9" * MAX_DIGITS), "last_number")


def test_reference_answer():
    assert reference_answer("steps <<2*3=6>>\n#### 1,234") == 1234
    assert reference_answer("#### -7") == -7
    assert reference_answer("42") == 42
    with pytest.raises(ValueError, match="does not end in a number"):
        reference_answer("#### none")


def test_reward_and_reasons():
    assert score("The answer is 18.") == {"reward": 1.0, "boxed": 0.0}
    assert score("\\boxed{18}") == {"reward": 1.0, "boxed": 1.0}
    assert score("\\boxed{17}, or maybe 18") == {"reward": 0.0, "boxed": 1.0, "reason": "wrong_answer"}
    assert score("0.5", answer="1/2")["reward"] == 1.0
    assert score("$1,234.00", answer="1,234")["reward"] == 1.0
    assert score("It is 18, not 19.")["reward"] == 0.0  # several numbers: the last one counts
    assert score("nothing")["reason"] == "no_number"
    assert score(None) == {"reward": 0.0, "boxed": 0.0, "reason": "no_final"}


def test_only_the_final_channel_counts():
    messages = [
        {"channel": "analysis", "recipient": None, "content": "The answer is 18."},
        {"channel": "commentary", "recipient": "functions.calc", "content": "18"},
    ]
    assert gsm8k_reward(messages, gsm8k_row("18"))["reason"] == "no_final"
    messages.append({"channel": "final", "recipient": None, "content": "It is 19."})
    assert gsm8k_reward(messages, gsm8k_row("18"))["reward"] == 0.0


MEGABYTES = {
    "huge_number": "7" * 1_000_000,
    "huge_grouped_number": "1," + "234," * 250_000 + "5",
    "no_number": "x " * 500_000,
    "many_numbers": "1 " * 500_000,
    "unclosed_box": "\\boxed{" + "{" * 1_000_000,
    "signs_and_slashes": "-" * 500_000 + "1/" * 250_000,
    "arabic_indic_digits": "\u0661" * 1_000_000,
    "decimal_points": "1." * 500_000,
}


@pytest.mark.parametrize("text", MEGABYTES.values(), ids=MEGABYTES.keys())
def test_a_megabyte_scores_in_bounded_time(text):
    start = time.perf_counter()
    result = score(text)
    assert result["reward"] == 0.0
    assert time.perf_counter() - start < 5.0


def test_parse_number_whole_string():
    assert parse_number(" $18. ") == 18
    assert parse_number("18 apples") is None
    assert parse_number("9" * (MAX_DIGITS + 1)) is None
