"""A character-level tokenizer over the arithmetic alphabet: 18 tokens, fixed ids.

Token ids (stable; checkpoints and recorded runs depend on them):

    id  token      id  token
     0  <pad>      10  '7'
     1  <bos>      11  '8'
     2  <eos>      12  '9'
     3  '0'        13  '+'
     4  '1'        14  '-'
     5  '2'        15  '*'
     6  '3'        16  '='
     7  '4'        17  ' '
     8  '5'
     9  '6'

`vocab_size` is 18. A model may have a larger (padded) vocabulary, such as the demo model's 32:
ids 18..31 then name no token, and `decode` rejects them.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = "0123456789+-*= "
TOKENS = SPECIAL_TOKENS + tuple(CHARACTERS)


class CharTokenizer:
    """One token per character of `CHARACTERS`, plus the special tokens <pad>, <bos> and <eos>.

    `encode` reads special tokens written out in the text ("<bos>3+5=" -> [1, 6, 13, 8, 16]), so
    `encode(decode(ids)) == ids` and `decode(encode(text)) == text` for every encodable text.
    """

    def __init__(self) -> None:
        self.tokens: tuple[str, ...] = TOKENS
        self.token_to_id: dict[str, int] = {token: i for i, token in enumerate(TOKENS)}
        self.vocab_size: int = len(TOKENS)
        self.pad_token_id: int = self.token_to_id[PAD]
        self.bos_token_id: int = self.token_to_id[BOS]
        self.eos_token_id: int = self.token_to_id[EOS]
        self.special_token_ids: frozenset[int] = frozenset(self.token_to_id[t] for t in SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; "<pad>", "<bos>" and "<eos>" written in the text become their ids.

        Raises ValueError naming the character and its position if a character has no token.
        """
        ids: list[int] = []
        i = 0
        while i < len(text):
            special = next((t for t in SPECIAL_TOKENS if text.startswith(t, i)), None)
            if special is not None:
                ids.append(self.token_to_id[special])
                i += len(special)
                continue
            char = text[i]
            if char not in self.token_to_id:
                raise ValueError(
                    f"cannot encode character {char!r} at position {i} of {text!r}; "
                    f"the vocabulary holds {CHARACTERS!r} and the special tokens {SPECIAL_TOKENS}"
                )
            ids.append(self.token_to_id[char])
            i += 1
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`, every id rendered (nothing stops at <eos>).

        Special tokens are written as "<pad>", "<bos>", "<eos>", or left out when
        `skip_special_tokens`. Accepts a list of ints or a 1-D integer tensor. Raises ValueError
        naming the id if an id is outside [0, vocab_size).
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        pieces: list[str] = []
        for position, token_id in enumerate(ids):
            token_id = int(token_id)
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"cannot decode token id {token_id} at position {position}; "
                    f"valid ids are 0..{self.vocab_size - 1}"
                )
            if skip_special_tokens and token_id in self.special_token_ids:
                continue
            pieces.append(self.tokens[token_id])
        return "".join(pieces)

    def __len__(self) -> int:
        return self.vocab_size
