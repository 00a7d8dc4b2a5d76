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
from ds4serve.scheduler.step_costs import StepCosts

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
    _views_equal(got, ref)


def _views_equal(got, ref, padded: bool = False) -> None:
    """``got`` is ``ref``, array for array; ``padded``: a reused view's visible rows may run on past
    ``ref``'s, to a multiple of ``VIS_QUANTUM``, as invalid entries (row 0)."""
    assert got.rings_after_write == ref.rings_after_write
    for f in ("ids", "positions", "swa_keys", "swa_valid", "swa_dst", "swa_src"):
        _same(getattr(got, f), getattr(ref, f), f)
    assert got.compress.keys() == ref.compress.keys() and got.visible.keys() == ref.visible.keys()
    for k, ci in ref.compress.items():
        for f in ("emit_slots", "emit_valid", "emit_pos", "emit_rows", "ring_dst", "ring_src"):
            _same(getattr(got.compress[k], f), getattr(ci, f), f"{k} {f}")
    for r, vr in ref.visible.items():
        rows, valid, w = got.visible[r].rows, got.visible[r].valid, vr.rows.shape[1]
        if padded:
            assert rows.shape[1] % native_view.VIS_QUANTUM == 0 and w <= rows.shape[1] < w + native_view.VIS_QUANTUM
            assert not valid[:, w:].any() and not rows[:, w:].any(), f"visible {r} padding"
            rows, valid = rows[:, :w], valid[:, :w]
        _same(rows, vr.rows, f"visible {r} rows")
        _same(valid, vr.valid, f"visible {r} valid")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_reused_view_equals_a_fresh_one_step_after_step(name):
    """Decode steps of 3 sequences, one token on each step (and a draft of 2 now and then): the buffers are
    refilled while the view's shape holds (the same object back) and replaced when it changes, and every
    view equals one built from nothing (the torch form)."""
    layout = StateLayout.build(ModelConfig.from_dict(CONFIGS[name]), torch.float32)
    reuse = native_view.ViewReuse()
    starts = {0: 8, 3: 64, 6: 128}  # in step modulo the compress ratios, as a batch that started together
    pages = {slot: list(range(8 * i, 8 * i + 8)) for i, slot in enumerate(starts)}
    seen: list[object] = []
    for step in range(40):
        draft = 2 if step % 9 == 4 else 0
        chunks = [SeqChunk(slot, pos + step, [2 + (pos + step) % 200] + [7] * (draft if slot == 3 else 0),
                           pages[slot]) for slot, pos in starts.items()]
        ref = build_view(layout, N_SLOTS, chunks, torch.device("cpu"), tiles=True)
        got = build_view(layout, N_SLOTS, chunks, torch.device("cpu"), tiles=False, reuse=reuse)
        _views_equal(got, ref, padded=True)
        seen.append(got)
    assert reuse.reused >= 30  # most steps keep the capacity (the closing windows' count moves within it)
    assert len({id(v) for v in seen}) > 2  # a draft, the window filling: new buffers


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


class _Pinned(StepCosts):
    draft_cost = 0.0
    per_draft = 0.0

    def costs(self):
        return (1e-3, 0.0, 1e-6)


@pytest.mark.parametrize("speculative", [None, '{"method": "dspark"}'])
def test_the_engine_answers_the_same_with_its_views_refilled_in_place(speculative):
    """The bundled model, three streams of 40 tokens with logprobs (and with its DSpark drafter, whose verify
    steps' views close a varying number of compressor windows): refilling the merged forward's view in place
    (its visible rows padded, and the native forward's descriptor of it kept) changes no token and no
    logprob bit."""
    from ds4serve.bench.spec_bench import TINY, prompts
    from ds4serve.llm import LLM

    fresh, reused = LLM(TINY, max_seqs=3, speculative=speculative), LLM(TINY, max_seqs=3, speculative=speculative)
    fresh.core.executor._merged_view = None
    for llm in (fresh, reused) if speculative else ():  # costs under which every block pays: verify steps
        llm.core.scheduler.step_costs.__class__ = _Pinned
        llm.core.scheduler.draft_guard.allows = lambda width: True
    asks = prompts(3, fresh.core.cfg.vocab_size, length=80)  # past the sliding window: its width holds
    got = [llm.generate_with_logprobs(asks, max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
           for llm in (fresh, reused)]
    assert reused.core.executor._merged_view.reused > 10
    assert got[0] == got[1] and all(len(lps) == 40 for _, lps in got[0])
    if speculative:
        assert reused.core.stats.speculation.get("verify_steps", 0) > 0
