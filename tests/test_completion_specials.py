"""``/v1/completions`` text prompts match DS4 special-token text as vLLM and llama-server do, and
honour vLLM's ``add_special_tokens``; ``/tokenize`` with a prompt agrees with what is prefilled."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from ds4serve.chat import ChatFormatError, render_completion
from ds4serve.chat.tokenizer import ASSISTANT, BOS, IMAGE, THINK_END, USER, Tokenizer

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"
CHAT_TEXT = f"{BOS}You are terse.{USER}hi there{ASSISTANT}{THINK_END}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(BUNDLED)


def test_special_text_becomes_its_token(tok):
    ids = render_completion(tok, f"a{USER}b{ASSISTANT}")
    assert ids[0] == tok.bos_id and tok.user_id in ids and tok.assistant_id in ids
    assert ids == [tok.bos_id] + tok.encode_text("a") + [tok.user_id] + tok.encode_text("b") + [tok.assistant_id]
    # the same ids the HF tokenizers library gives with added-token matching on (what vLLM runs)
    assert ids[1:] == HFTokenizer.from_file(str(BUNDLED / "tokenizer.json")).encode(
        f"a{USER}b{ASSISTANT}", add_special_tokens=False).ids


def test_bos_is_added_once_and_only_when_asked(tok):
    plain = render_completion(tok, "hello world")
    assert plain == [tok.bos_id] + tok.encode_text("hello world")  # prompts without special text: as before
    assert render_completion(tok, "hello world", add_special_tokens=False) == plain[1:]
    rendered = render_completion(tok, CHAT_TEXT)
    assert rendered[:2] == [tok.bos_id] + tok.encode_text("You")[:1]  # its own BOS, not a second one
    assert rendered.count(tok.bos_id) == 1
    assert render_completion(tok, CHAT_TEXT, add_special_tokens=False) == rendered


def test_image_placeholder_is_still_refused(tok):
    with pytest.raises(ChatFormatError, match="image placeholder"):
        render_completion(tok, f"look {IMAGE}")


def _tokenize(server, **body) -> list[int]:
    r = httpx.post(server.base + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _prompt_tokens(server, **body) -> int:
    r = httpx.post(server.base + "/v1/completions", timeout=120,
                   json={"model": "tiny", "max_tokens": 1, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_completions_and_tokenize_agree_over_http(server):
    tok = server.state.tokenizer
    ids = _tokenize(server, prompt=f"x{USER}y")
    assert ids == [tok.bos_id] + tok.encode_text("x") + [tok.user_id] + tok.encode_text("y")
    assert len(ids) == 4
    assert _prompt_tokens(server, prompt=f"x{USER}y") == 4
    assert _tokenize(server, prompt=f"x{USER}y", add_special_tokens=False) == ids[1:]
    assert _prompt_tokens(server, prompt=f"x{USER}y", add_special_tokens=False) == 3
    with_bos = _tokenize(server, prompt=f"{BOS}x")
    assert with_bos == _tokenize(server, prompt="x") == [ids[0], ids[1]]
    assert _prompt_tokens(server, prompt=f"{BOS}x") == 2
    # token-id prompts go in as sent, whatever the flag
    assert _prompt_tokens(server, prompt=ids) == 4
    assert _prompt_tokens(server, prompt=ids[1:], add_special_tokens=True) == 3


def test_empty_prompt_is_refused_either_way(server):
    for flag in (True, False):
        r = httpx.post(server.base + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "", "add_special_tokens": flag})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
