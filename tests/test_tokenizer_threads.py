"""The tokenizer keeps one ``tokenizers`` backend per thread.

The server tokenizes in a worker pool while the event loop detokenizes; a shared Rust tokenizer
object carries per-instance settings (``encode_special_tokens``) that must hold in every thread, so
each thread builds and then keeps its own backend. These tests pin that: distinct objects across
threads, the same object within one, the safety setting in each, and correct ids under concurrency.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ds4serve.chat import Tokenizer
from ds4serve.chat.tokenizer import USER

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "ds4v-tiny"

TEXTS = [f"{i}: Hello, wörld! {'ab' * (i % 7)} 😀 {USER} {i * 7919}" for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUNDLED)


def test_two_threads_get_distinct_backends_and_each_keeps_its_own(tok):
    mine = tok._tok()
    assert tok._tok() is mine  # the same thread reuses its backend
    seen: dict[str, tuple] = {}
    both_built = threading.Barrier(2)

    def work(name: str) -> None:
        first = tok._tok()
        both_built.wait(timeout=10)  # both threads hold a backend at the same time
        seen[name] = (first, tok._tok(), first.encode_special_tokens)

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    (a1, a2, a_safe), (b1, b2, b_safe) = seen["a"], seen["b"]
    assert a1 is a2 and b1 is b2
    assert len({id(mine), id(a1), id(b1)}) == 3
    assert a_safe and b_safe  # every thread's backend treats special-token text as plain text


def test_concurrent_encode_and_decode_match_one_thread(tok):
    want = [tok.encode_text(t) for t in TEXTS]
    want_text = [tok.decode(ids) for ids in want]
    assert all(tok.user_id not in ids for ids in want)  # "<｜User｜>" typed by a user stays text

    def roundtrip(i: int) -> tuple[list[int], str]:
        ids = tok.encode_text(TEXTS[i])
        return ids, tok.decode(ids)

    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            got = list(pool.map(roundtrip, range(len(TEXTS))))
            assert [g[0] for g in got] == want
            assert [g[1] for g in got] == want_text
