"""A byte-level tokenizer with the DS4 special tokens (no merges): any text round-trips.

Used by the random placeholder checkpoint; ids 0..7 are the specials (BOS 0, EOS 1 as in DS4).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..chat.tokenizer import ASSISTANT, BOS, EOS, IMAGE, THINK, THINK_END, USER

SPECIAL_ORDER = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, IMAGE, "<｜pad｜>")


def build_byte_tokenizer() -> Tokenizer:
    vocab = {s: i for i, s in enumerate(SPECIAL_ORDER)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_ORDER])
    return tok
