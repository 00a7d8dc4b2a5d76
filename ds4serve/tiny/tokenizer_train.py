"""Train the tiny model's byte-level BPE tokenizer (``tokenizers``) on the synthetic corpus.

The DS4 special tokens come first (BOS 0, EOS 1, User, Assistant, <think>, </think>, the image
placeholder, pad), so the chat encoding and config ids match the real DS4 conventions. Training is
deterministic for a given corpus.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .byte_tokenizer import SPECIAL_ORDER
from .data import corpus


def train_tokenizer(seed: int = 1234, n_examples: int = 20000, vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_ORDER),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(seed, n_examples), trainer=trainer)
    for i, s in enumerate(SPECIAL_ORDER):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok
