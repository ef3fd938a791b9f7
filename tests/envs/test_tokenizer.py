import pytest
import torch

from megatron_gptoss.envs.tokenizer import CharTokenizer


def test_ids_are_stable():
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == len(tok) == 18 <= 32
    assert tok.encode("0123456789+-*= ") == list(range(3, 18))


def test_round_trip():
    tok = CharTokenizer()
    for text in ["3+5=", "<bos>12-7=-5<eos><pad>", "9*9=81", " ", ""]:
        assert tok.decode(tok.encode(text)) == text
    ids = list(range(tok.vocab_size))
    assert tok.encode(tok.decode(ids)) == ids


def test_decode_specials_rendered_or_skipped():
    tok = CharTokenizer()
    ids = tok.encode("<bos>3+5=8<eos>7<pad>")
    assert tok.decode(ids) == "<bos>3+5=8<eos>7<pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "3+5=87"
    assert tok.decode(torch.tensor(ids)) == tok.decode(ids)


def test_clear_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        tok.encode("3+x=")
    with pytest.raises(ValueError, match=r"'<' at position 0"):
        tok.encode("<unk>")
    with pytest.raises(ValueError, match="token id 18"):
        tok.decode([3, 18])
