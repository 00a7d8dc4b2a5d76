"""Captures for a model drafter (``engine/capture.py``): splitting the forward after the captured layers
changes no bit of the target's results, the native and the torch forward alike, and each capture is the
layer's output (checked against a forward stopped at that layer, on a twin engine that never split)."""

from __future__ import annotations

import pytest
import torch

from ds4serve.cache import SeqChunk
from ds4serve.engine.capture import CapturePlan
from ds4serve.llm import LLM


def _twins(ckpt_factory, host: str):
    _, path = ckpt_factory("B")
    return tuple(LLM(path, max_seqs=2, host_kernels=host, warmup=False) for _ in range(2))


def _steps(vocab: int) -> list[list[tuple[int, list[int]]]]:
    """A prompt of 37 tokens in two chunks, then three decode rows with a 2-token draft: (start, ids)."""
    prompt = [(5 + 11 * i) % (vocab - 3) + 2 for i in range(37)]
    return [[(0, prompt[:20])], [(20, prompt[20:])], [(37, [4, 9, 3])], [(40, [7])]]


def _run(llm: LLM, plan: CapturePlan | None, steps, stop: int | None = None):
    """Each step's final streams (or, with ``stop``, the streams after layer ``stop - 1``) and its captures."""
    cache, engine = llm.core.cache, llm.core.executor
    engine.capture = plan
    slot = cache.alloc_slot()
    out = []
    try:
        for chunk in steps:
            start, ids = chunk[0]
            assert cache.reserve({slot: start + len(ids) + 1})
            view = engine._view([SeqChunk(slot, start, ids, cache.block_table(slot))])
            with torch.inference_mode():
                if stop is not None:
                    streams = engine._segment(view, None, None, 0, stop)
                    out.append((streams, None))
                else:
                    into: dict[int, torch.Tensor] = {}
                    streams = engine._forward(view, into if plan else None)
                    out.append((streams, plan.rows(into) if plan else None))
    finally:
        engine.capture = None
        cache.drop(slot)
    return out


@pytest.mark.parametrize("host", ["on", "off"])
def test_a_split_forward_is_the_forward_and_captures_layer_outputs(ckpt_factory, host):
    plain, split = _twins(ckpt_factory, host)
    L = plain.core.cfg.num_layers
    hc, d = plain.core.cfg.hc_mult, plain.core.cfg.hidden_size
    steps = _steps(plain.core.cfg.vocab_size)
    dspark = CapturePlan(tuple(range(L)), mean_hc=True)  # every layer: a split after each
    want = _run(plain, None, steps)
    got = _run(split, dspark, steps)
    for (w, _), (g, cap) in zip(want, got):
        assert torch.equal(w, g)  # the target's streams: not a bit changed by splitting
        assert cap.shape == (g.shape[0], dspark.width(hc, d))
        assert torch.equal(cap[:, -d:], g.mean(dim=1))  # the last layer's capture: the output, averaged
    for layer in range(L - 1):  # each earlier capture is that layer's output (a fresh twin run to it)
        fresh, _ = _twins(ckpt_factory, host)
        upto = _run(fresh, None, steps, stop=layer + 1)
        for (streams, _), (_, cap) in zip(upto, got):
            assert torch.equal(cap[:, layer * d:(layer + 1) * d], streams.mean(dim=1)), f"layer {layer}"


def test_mtp_captures_keep_every_copy_of_the_last_layer(ckpt_factory):
    plain, split = _twins(ckpt_factory, "on")
    L = plain.core.cfg.num_layers
    mtp = CapturePlan((L - 1,), mean_hc=False)
    steps = _steps(plain.core.cfg.vocab_size)
    for (w, _), (g, cap) in zip(_run(plain, None, steps), _run(split, mtp, steps)):
        assert torch.equal(w, g) and torch.equal(cap, g.reshape(g.shape[0], -1))


def test_plans_refuse_unordered_layers_and_report_missing_captures():
    with pytest.raises(ValueError, match="ascending"):
        CapturePlan((3, 1), mean_hc=True)
    with pytest.raises(ValueError, match="ascending"):
        CapturePlan((), mean_hc=True)
    with pytest.raises(RuntimeError, match=r"layer\(s\) \[2\]"):
        CapturePlan((1, 2), mean_hc=True).rows({1: torch.zeros(2, 4)})


def test_the_native_forward_captures_in_one_call_and_refuses_layers_outside_its_range(ckpt_factory, monkeypatch):
    """A split forward costs a native call, a step view and a scratch plan per piece; the native path
    captures inside one call, and a layer list it cannot honour is an error, never a silent skip."""
    llm, _ = _twins(ckpt_factory, "on")
    host, L = llm.core.executor.host, llm.core.cfg.num_layers
    calls = []
    real = host.lib.ds4_forward_captured
    monkeypatch.setattr(host.lib, "ds4_forward_captured", lambda *a: calls.append(a) or real(*a))
    got = _run(llm, CapturePlan(tuple(range(L)), mean_hc=True), _steps(llm.core.cfg.vocab_size))
    assert len(calls) == len(got) == 4
    cache, engine = llm.core.cache, llm.core.executor
    slot = cache.alloc_slot()
    assert cache.reserve({slot: 8})
    view = engine._view([SeqChunk(slot, 0, [3, 4, 5], cache.block_table(slot))])
    for layers, start, stop in (((1, 0), 0, L), ((L,), 0, L + 1), ((0,), 1, L)):
        with pytest.raises(ValueError, match="captured layers"):
            host.forward_captured(view, layers, True, start, stop)
    cache.drop(slot)


def test_rows_of_one_native_capture_are_that_matrix_and_anything_else_is_concatenated():
    """``rows`` of ``split``'s views is the forward's own matrix (no copy); captures from separate tensors
    (a torch forward's, a pass's layers) or not in ``layers`` order are concatenated as before."""
    plan = CapturePlan((1, 2, 3), mean_hc=True)
    whole = torch.randn(4, 3 * 8)
    into: dict[int, torch.Tensor] = {}
    plan.split(plan.layers, whole, into)
    assert plan.rows(into) is whole
    views = {layer: whole[:, j * 8:(j + 1) * 8] for j, layer in enumerate(plan.layers)}
    assert plan.rows(views) is whole  # views tiling the matrix in order are that matrix too
    apart = {layer: whole[:, j * 8:(j + 1) * 8].clone() for j, layer in enumerate(plan.layers)}
    assert torch.equal(plan.rows(apart), whole) and plan.rows(apart) is not whole
    swapped = {1: views[2], 2: views[1], 3: views[3]}
    assert torch.equal(plan.rows(swapped), torch.cat([views[2], views[1], views[3]], dim=1))
    partial: dict[int, torch.Tensor] = {}
    plan.split((1, 2), whole[:, :16], partial)  # a slice's layers (one view of a view: not the whole matrix)
    partial[3] = whole[:, 16:]
    assert torch.equal(plan.rows(partial), whole)
