"""Prefill over shared key blocks (query tiles) computes what per-query gathered key lists compute.

The tiled path is a different arithmetic shape for the same attention: one sliding key block per
tile (ring rows before the chunk, then the chunk's rows) and masks, compressed rows shared (HCA) or
top-k rows scored against a shared indexer block (CSA). Forcing the gather path (``TILE_MIN`` above
every chunk) gives the reference; both must agree to fp32 rounding on every parity config, for
whole prompts and for chunked prefill whose later chunks read the ring, with several sequences in
one forward. Parity against transformers itself is ``test_model_parity.py`` (which now runs tiles).
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import random_ids

from ds4serve.cache import SeqChunk, build_view, view


def _prefill(llm, prompts: list[list[int]], chunk: int) -> torch.Tensor:
    """Logits of every token of every prompt, prefilled together in chunks of ``chunk`` tokens."""
    cache = llm.core.cache
    slots = [cache.alloc_slot() for _ in prompts]
    outs: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        for start in range(0, max(len(p) for p in prompts), chunk):
            live = [(i, s) for i, s in enumerate(slots) if start < len(prompts[i])]
            pieces = [prompts[i][start:start + chunk] for i, _ in live]
            for (i, s), piece in zip(live, pieces):
                assert cache.reserve({s: start + len(piece)})
            logits = llm.reference.forward([SeqChunk(s, start, piece, cache.block_table(s))
                                         for (_, s), piece in zip(live, pieces)], all_logits=True)
            offset = 0
            for (i, _), piece in zip(live, pieces):
                outs[i].append(logits[offset:offset + len(piece)])
                offset += len(piece)
    finally:
        for s in slots:
            cache.drop(s)
    return torch.cat([torch.cat(o) for o in outs])


@pytest.mark.parametrize("name", ["A", "B", "C"])
@pytest.mark.parametrize("chunk", [1000, 48, 17])
def test_tiles_equal_per_query_gathers(llm_factory, name, chunk, monkeypatch):
    llm = llm_factory(name, max_seqs=4)
    vocab = llm.cfg.vocab_size
    # lengths around the window, the compress ratios and several tiles (TILE = 128)
    prompts = [random_ids(n, vocab, seed=300 + n) for n in (300, 129, 40, 5)]
    tiled = _prefill(llm, prompts, chunk)
    monkeypatch.setattr(view, "TILE_MIN", 10**9)
    gathered = _prefill(llm, prompts, chunk)
    torch.testing.assert_close(tiled, gathered, rtol=0, atol=2e-5)


def test_a_long_chunk_is_tiled_and_short_rows_gather(llm_factory):
    llm = llm_factory("A", max_seqs=4)
    cache = llm.core.cache
    a, b = cache.alloc_slot(), cache.alloc_slot()
    try:
        assert cache.reserve({a: 300, b: 30})
        v = build_view(cache.layout, cache.n_slots, [SeqChunk(a, 0, list(range(1, 301)), cache.block_table(a)),
                                                     SeqChunk(b, 20, [5], cache.block_table(b))], llm.device)
        assert [(t.start, t.stop) for t in v.tiles] == [(0, 128), (128, 256), (256, 300)]
        assert v.gather_tokens.tolist() == [300]
        window = llm.cfg.sliding_window
        for t in v.tiles:  # each query keeps exactly its own window
            assert t.swa_mask.sum(1).tolist() == [min(p + 1, window) for p in range(t.start, t.stop)]
    finally:
        cache.drop(a)
        cache.drop(b)
