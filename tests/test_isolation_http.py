"""Through HTTP: image prompts of 1,020-1,060 tokens while another stream decodes (issue: staging
overflow). Before the fix, a prompt whose first chunk swallowed a short tail past
``max_prefill_tokens`` failed its step, and with it the unrelated decoding stream."""

from __future__ import annotations

import threading

import pytest
from image_helpers import image_url
from openai import OpenAI

from ds4serve.chat import Tokenizer, render_chat
from ds4serve.multimodal.pipeline import ImagePipeline
from ds4serve.tiny.random_model import BUNDLED

pytestmark = pytest.mark.skipif(not (BUNDLED / "model.safetensors").exists(), reason="bundled model not present")


def _content(text: str) -> list[dict]:
    """An image, then the text (so the block's position, and its lead pads, stay fixed)."""
    return [{"type": "image_url", "image_url": {"url": image_url(1)}}, {"type": "text", "text": text}]


def _texts_by_length(core, tok, lengths: range) -> dict[int, str]:
    """For each prompt length in ``lengths``, a text that gives exactly that many prompt tokens after
    one image (rendered and expanded as the server does)."""
    out: dict[int, str] = {}
    pipe = ImagePipeline.for_engine(core, tok)
    n_chars = 900
    while n_chars < 1600 and len(out) < len(lengths):
        text = "".join("abcdefgh"[(i * 5) % 8] if i % 3 else " " for i in range(n_chars))
        ids = pipe.prepare(render_chat(tok, [{"role": "user", "content": _content(text)}])).ids
        if len(ids) in lengths:
            out.setdefault(len(ids), text)
        elif len(ids) > lengths.stop:
            break
        n_chars += 1
    return out


def test_image_prompts_around_the_staging_size_beside_a_decoding_stream():
    from server_harness import serve

    tok = Tokenizer(BUNDLED)
    with serve(BUNDLED, settings={"max_seqs": 8, "max_model_len": 2048}, random_weights=False) as srv:
        texts = _texts_by_length(srv.loop.core, tok, range(1020, 1061))
        assert len(texts) >= 35 and all(n in texts for n in range(1026, 1040)), sorted(texts)
        client = OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        stop = threading.Event()
        streams: list[tuple[int, str | None]] = []

        def decode_forever():
            while not stop.is_set():
                n, finish = 0, None
                for chunk in client.chat.completions.create(
                        model="tiny", max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True},
                        messages=[{"role": "user", "content": "What is 7 + 5?"}]):
                    n += bool(chunk.choices and chunk.choices[0].delta.content)
                    finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
                streams.append((n, finish))

        thread = threading.Thread(target=decode_forever, daemon=True)
        thread.start()
        try:
            for n, text in sorted(texts.items()):
                resp = client.chat.completions.create(
                    model="tiny", max_tokens=3, temperature=0,
                    messages=[{"role": "user", "content": _content(text)}])
                assert resp.usage.prompt_tokens == n
                assert resp.choices[0].finish_reason in ("stop", "length")
        finally:
            stop.set()
            thread.join(timeout=120)
        assert streams and all(finish == "length" for _, finish in streams), streams
        assert srv.loop.call(lambda core: core.leaks()) == ""
