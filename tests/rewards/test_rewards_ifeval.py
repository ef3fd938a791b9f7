import json
import time

import pytest
from helpers.reward_rows import completion, ifeval_row

from megatron_gptoss.rewards import VERIFIERS, follows, ifeval_reward, instructions

# (instruction id, kwargs, a response that follows it, one that does not)
CASES = [
    ("length_constraints:number_words", {"num_words": 3, "relation": "at least"}, "one two three", "one two"),
    ("length_constraints:number_words", {"num_words": 3, "relation": "at most"}, "one, two", "a b c d"),
    ("length_constraints:number_words", {"num_words": 2, "relation": "exactly"}, "one two", "one"),
    ("length_constraints:number_words", {"num_words": 3, "relation": "less than"}, "a b", "a b c"),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "exactly"}, "Hi. Bye!", "Hi."),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "A. B? C", "A 1.5"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "one\n***\ntwo", "one\n***\n\n***\ntwo"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "one\n\ntwo", "one\ntwo"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "a\n\nb\n \nc\n", "a\n\nb"),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\nThen, more.",
        "First.\n\nAfter, then.",
    ),
    ("keywords:existence", {"keywords": ["apple", "Pear"]}, "An APPLE and a pear.", "An apple."),
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "badly done", "not BAD at all"),
    ("keywords:frequency", {"keyword": "go", "frequency": 2, "relation": "at least"}, "Go go", "go"),
    ("keywords:frequency", {"keyword": "a.b", "frequency": 1, "relation": "exactly"}, "a.b", "axb axb"),
    (
        "keywords:letter_frequency",
        {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
        "zoo",
        "Zizz",
    ),
    ("detectable_format:json_format", {}, '{"a": [1, 2]}', "{'a': 1}"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', '```json\n{"a": 1}\n``` more'),
    ("detectable_format:json_format", {}, "```\n[1]\n```", "Here: {}"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n  - b\ntext", "* a\n**b**\n- c\n- d"),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and **b**", "*a* and **"),
    ("detectable_format:title", {}, "<<My Title>>\nbody", "<< >> and <<a\nb>>"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 2},
        "SECTION 1\na\nSECTION 2\nb",
        "SECTION 1\na",
    ),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] at [place]", "[name] at ["),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "x\np.p.s y", "x\np.s. y"),
    ("change_case:english_lowercase", {}, "all lower, 123.", "Not lower"),
    ("change_case:english_capital", {}, "ALL UPPER 123!", "ALL UPPEr"),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "THE END OF it",
        "The End",
    ),
    ("punctuation:no_comma", {}, "no commas here", "a, b"),
    ("startend:start_checker", {"start_phrase": "Dear Sir"}, "  dear sir, hello", "Hello, dear sir"),
    ("startend:end_checker", {"end_phrase": "Any questions?"}, 'Done. Any questions?"', "Any questions? No."),
    ("startend:quotation", {}, '"quoted"', '"half'),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "Say hi. Hi!", "Hi! Say hi."),
    ("combination:two_responses", {}, "One.\n******\nTwo.", "One.\n******\nOne."),
]


@pytest.mark.parametrize(
    "instruction, kwargs, good, bad", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_verifier_true_and_false(instruction, kwargs, good, bad):
    assert follows(good, instruction, kwargs) is True
    assert follows(bad, instruction, kwargs) is False


def test_every_verifier_is_tested():
    assert {case[0] for case in CASES} == set(VERIFIERS)


def test_unsupported_instruction_and_bad_kwargs_raise():
    with pytest.raises(ValueError, match="language:response_language.*not supported"):
        follows("hola", "language:response_language", {"language": "es"})
    with pytest.raises(ValueError, match="do not fit"):
        follows("x", "punctuation:no_comma", {"num_words": 3})
    with pytest.raises(ValueError, match="relation"):
        follows("x", "length_constraints:number_words", {"num_words": 3, "relation": "about"})


def test_instruction_layouts():
    ids = ["punctuation:no_comma", "keywords:existence"]
    hf_kwargs = [{"keywords": None, "num_words": None}, {"keywords": ["cat"], "num_words": None}]
    expected = (ids, [{}, {"keywords": ["cat"]}])
    assert instructions({"ground_truth": {"instruction_id_list": ids, "kwargs": hf_kwargs}}) == expected
    spec = json.dumps([{"instruction_id": ids, "kwargs": hf_kwargs}])
    assert instructions({"ground_truth": spec}) == expected  # a JSON string of a one-element list
    assert instructions(
        {"ground_truth": "", "extra_info": {"instruction_id_list": ids, "kwargs": hf_kwargs}}
    ) == (expected)
    with pytest.raises(ValueError, match="names no instructions"):
        instructions({"ground_truth": "42", "extra_info": {}})
    with pytest.raises(ValueError, match="2 instruction ids and 1 kwargs"):
        instructions({"ground_truth": {"instruction_id_list": ids, "kwargs": [{}]}})


def test_strict_and_fraction():
    row = ifeval_row(
        ["punctuation:no_comma", "change_case:english_lowercase", "keywords:existence"],
        [{}, {}, {"keywords": ["cat"]}],
    )
    half = completion("a cat, lower")  # follows 2 of 3
    assert ifeval_reward(half, row, mode="fraction") == pytest.approx(
        {"reward": 2 / 3, "followed": 2 / 3, "reason": "not_followed"}
    )
    assert ifeval_reward(half, row, mode="strict")["reward"] == 0.0
    assert ifeval_reward(completion("a cat"), row, mode="strict") == {"reward": 1.0, "followed": 1.0}
    assert ifeval_reward(completion(None), row)["reason"] == "no_final"
    # the analysis channel is not the response
    assert ifeval_reward(completion("A, B", analysis="a cat"), row, mode="strict")["reward"] == 0.0


MEGABYTES = {
    "brackets": "[" * 1_000_000,
    "angles": "<<" * 500_000,
    "asterisks": "*" * 1_000_000,
    "newlines": "\n" * 1_000_000,
    "spaces": " " * 1_000_000,
    "sentences": "a. " * 333_333,
    "fences": "```" * 333_333,
    "sections": "SECTION " * 125_000,
}


@pytest.mark.parametrize("text", MEGABYTES.values(), ids=MEGABYTES.keys())
def test_a_megabyte_verifies_in_bounded_time(text):
    start = time.perf_counter()
    for instruction, kwargs, _, _ in CASES:
        follows(text, instruction, kwargs)
    assert time.perf_counter() - start < 10.0
