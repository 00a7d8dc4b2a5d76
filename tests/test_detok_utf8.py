"""Streaming text holds back only a UTF-8 character that later bytes could still complete
(chat/detok.py): an incomplete lead sequence waits for its continuation bytes, a byte nothing can repair
(a lone continuation byte, 0xF8-0xFF, a lead followed by a wrong byte) goes out at once as U+FFFD; and
whatever the bytes, the pushed pieces add up to the whole decode."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ds4serve.chat import IncrementalDetokenizer, Tokenizer

TINY = Path(__file__).resolve().parents[1] / "models" / "ds4v-tiny"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TINY)


def _byte_token(tok: Tokenizer, b: int) -> int:
    """The vocabulary's single-byte token for byte ``b`` (ByteLevel: every byte has one)."""
    char = next(c for c, v in tok._byte_of_char.items() if v == b)
    i = tok._tok().token_to_id(char)
    assert i is not None, hex(b)
    return i


def test_the_bundled_tokenizer_maps_tokens_to_their_bytes(tok):
    ids = tok.encode_text("héllo 世界")
    assert tok.token_bytes(ids) == "héllo 世界".encode()
    assert tok.token_bytes([tok.bos_id, *ids]) == "héllo 世界".encode()  # a skipped special: no bytes
    assert tok.token_bytes([tok.bos_id], skip_special_tokens=False) == tok.decode([tok.bos_id], False).encode()


def test_an_incomplete_character_waits_for_its_bytes(tok):
    d = IncrementalDetokenizer(tok)
    lead, *rest = "世".encode()  # e4 b8 96
    assert d.push(tok.encode_text("a")) == "a"
    assert d.push([_byte_token(tok, lead)]) == ""
    assert d.push([_byte_token(tok, rest[0])]) == ""
    assert d.push([_byte_token(tok, rest[1])]) == "世"


@pytest.mark.parametrize("bad", [[0xB0], [0xF9], [0xC0], [0xE0, 0x41], [0xE0, 0x80], [0xF4, 0x90]])
def test_a_byte_nothing_can_repair_goes_out_at_once(tok, bad):
    """Lone continuation byte, bytes that never start a character, a lead byte then a byte it cannot
    take (0x41; E0 80 would be overlong, F4 90 past U+10FFFF): no later byte changes them, so no step
    waits on them."""
    d = IncrementalDetokenizer(tok)
    got = [d.push([_byte_token(tok, b)]) for b in bad]
    assert "\ufffd" in got[-1]
    assert "".join(got) + d.flush() == tok.decode([_byte_token(tok, b) for b in bad])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0x80, 0xFF).map(lambda b: ("byte", b)),
                          st.sampled_from(["a", " the", "é", "世界", "\n"]).map(lambda t: ("text", t))),
                max_size=14))
def test_pieces_add_up_to_the_whole_decode(tok, parts):
    ids = []
    for kind, v in parts:
        ids += [_byte_token(tok, v)] if kind == "byte" else tok.encode_text(v)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([i]) for i in ids]
    assert "".join(pieces) + d.flush() == tok.decode(ids)
    for n in range(1, len(ids) + 1):  # never a character that later bytes change
        assert tok.decode(ids).startswith("".join(pieces[:n]))
