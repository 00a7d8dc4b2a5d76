"""The native index view (cache/native_view.py) equals build_view's torch form, array for array."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import CONFIG_B, CONFIG_C_OFFICIAL, APPENDIX_A
from ds4serve.cache import SeqChunk, StateLayout, build_view
from ds4serve.cache import native_view
from ds4serve.config import ModelConfig

CONFIGS = {"A": APPENDIX_A, "B": CONFIG_B, "C": CONFIG_C_OFFICIAL}
N_SLOTS, N_PAGES = 8, 64


@pytest.fixture(autouse=True)
def _built():
    if native_view.library() is None:
        pytest.skip(f"no native view builder here: {native_view._library.failure}")


@st.composite
def forwards(draw):
    """A config, and 1-5 chunks on distinct slots with random starts, lengths and block tables."""
    name = draw(st.sampled_from(sorted(CONFIGS)))
    layout = StateLayout.build(ModelConfig.from_dict(CONFIGS[name]), torch.float32)
    decode = draw(st.booleans())
    slots = draw(st.lists(st.integers(0, N_SLOTS - 1), min_size=1, max_size=5, unique=True))
    pages = iter(draw(st.permutations(range(N_PAGES))))
    chunks = []
    for slot in slots:
        start = draw(st.integers(0, 300))
        n = 1 if decode else draw(st.integers(1, 70))
        table = [next(pages) for _ in range(layout.pages_for(start + n))]
        ids = draw(st.lists(st.integers(2, 250), min_size=n, max_size=n))
        chunks.append(SeqChunk(slot, start, ids, table))
    return layout, chunks


def _same(a, b, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


@settings(max_examples=150, deadline=None)
@given(forwards())
def test_native_view_equals_build_view(case):
    layout, chunks = case
    ref = build_view(layout, N_SLOTS, chunks, torch.device("cpu"), tiles=True)  # tiles: the torch form
    ids = torch.cat([torch.as_tensor(c.ids, dtype=torch.int64) for c in chunks])
    got = native_view.text_view(layout, N_SLOTS, chunks, ids)
    assert got is not None and native_view.plain_text(chunks, torch.device("cpu"))
    assert got.rings_after_write == ref.rings_after_write
    for f in ("ids", "positions", "swa_keys", "swa_valid", "swa_dst", "swa_src"):
        _same(getattr(got, f), getattr(ref, f), f)
    assert got.compress.keys() == ref.compress.keys() and got.visible.keys() == ref.visible.keys()
    for k, ci in ref.compress.items():
        for f in ("emit_slots", "emit_valid", "emit_pos", "emit_rows", "ring_dst", "ring_src"):
            _same(getattr(got.compress[k], f), getattr(ci, f), f"{k} {f}")
    for r, vr in ref.visible.items():
        _same(got.visible[r].rows, vr.rows, f"visible {r} rows")
        _same(got.visible[r].valid, vr.valid, f"visible {r} valid")


def test_build_view_takes_the_native_form_only_for_plain_text(random_ckpt):
    """Without tiles, a plain text forward gets the native view; image blocks and snapshots inside a
    chunk keep the torch form (their rules live in build_view only)."""
    from ds4serve.multimodal.records import ImageSpan

    layout = StateLayout.build(ModelConfig.from_file(random_ckpt), torch.float32)
    plain = [SeqChunk(0, 0, list(range(2, 40)), [0])]
    view = build_view(layout, N_SLOTS, plain, torch.device("cpu"), tiles=False)
    assert view.tiles == () and view.gather_tokens is None
    assert native_view.plain_text(plain, torch.device("cpu"))
    captured = [SeqChunk(0, 0, list(range(2, 40)), [0], captures=((20, 0),))]
    assert not native_view.plain_text(captured, torch.device("cpu"))
    span = ImageSpan(start=5, end=15, visible_start=5, visible_end=14)
    assert not native_view.plain_text([SeqChunk(0, 0, list(range(2, 40)), [0], spans=(span,))],
                                      torch.device("cpu"))
    before = [SeqChunk(0, 20, list(range(2, 10)), [0], spans=(span,))]  # a block earlier in the sequence
    assert native_view.plain_text(before, torch.device("cpu"))
    assert not native_view.plain_text(plain, torch.device("meta"))
