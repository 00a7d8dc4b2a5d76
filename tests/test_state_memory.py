"""The state is sized for the worst case but costs what the traffic uses (issue 12, memory).

The page pools and the pass staging are reserved uninitialised: on the host, untouched memory is
not resident. A page is zeroed when it is first handed out, so a sequence still starts from zero
pages; the staging is written before it is read. These tests check both halves: the memory, and
that nothing ever reads the uninitialised bytes (poisoned with NaN here, the worst garbage).
"""

from __future__ import annotations

import sys

import pytest
import torch

from ds4serve.cache.manager import CacheManager
from model_helpers import random_ids


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_big_pool_and_staging_cost_no_resident_memory_until_used(llm_factory):
    layout = llm_factory("A", max_seqs=1).core.cache.layout
    n_pages = (512 << 20) // layout.bytes_per_page()  # ~512 MiB of pages
    before = _rss_bytes()
    cache = CacheManager(layout, n_slots=8, n_pages=n_pages, device="cpu", host_budget_bytes=0, staging_rows=4096)
    reserved = cache.state.allocated_bytes() + cache.staging.numel() * cache.staging.element_size()
    grown = _rss_bytes() - before
    assert reserved > 600 << 20
    assert grown < 64 << 20, f"{grown / 2**20:.0f} MiB resident for {reserved / 2**20:.0f} MiB reserved"
    slot = cache.alloc_slot()
    assert cache.reserve({slot: 4 * layout.page_tokens}) and len(cache.block_table(slot)) == 4
    assert _rss_bytes() - before < 64 << 20  # four zeroed pages, not the pool


def _poison_unused(llm) -> None:
    """NaN into every pool row of every page (the scratch page excepted: it is zeroed at start-up)
    and all of the staging: the worst that uninitialised memory could hold."""
    cache = llm.core.cache
    assert cache.state.pages.used_pages == 0
    for st in cache.state.layers:
        for pool in (st.comp_pool, st.idx_pool):
            if pool is not None:
                n = pool.shape[0] - pool.shape[0] // (cache.state.n_pages + 1)
                pool[:n].fill_(float("nan"))
    cache.staging.fill_(float("nan"))
    cache.state._zeroed[:] = bytes(len(cache.state._zeroed))  # every page counts as never handed out


def test_pages_are_zero_when_first_handed_out_and_garbage_is_never_read(llm_factory):
    clean = llm_factory("A", max_seqs=4, max_prefill_tokens=64)
    prompts = [random_ids(n, 1000, seed=90 + n) for n in (5, 70, 150, 260)]
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = clean.generate(prompts, **kw)
    dirty = llm_factory("A", max_seqs=4, max_prefill_tokens=64, step_tokens=77)
    _poison_unused(dirty)
    slot = dirty.core.cache.alloc_slot()
    assert dirty.core.cache.reserve({slot: 3 * dirty.core.cache.layout.page_tokens})
    for st in dirty.core.cache.state.layers:
        for pool in (st.comp_pool, st.idx_pool):
            if pool is not None:
                rpp = pool.shape[0] // (dirty.core.cache.state.n_pages + 1)
                for p in dirty.core.cache.block_table(slot):
                    assert torch.count_nonzero(pool[p * rpp:(p + 1) * rpp]) == 0
    dirty.core.cache.drop(slot)
    assert dirty.generate(prompts, **kw) == want


def test_a_model_of_sliding_layers_only_needs_no_pages_and_runs(tmp_path):
    """Only sliding-window layers: no compressed state, so a page costs 0 bytes. Sizing the page pool
    divided by that (ZeroDivisionError at start-up); such a model must start and decode, on both paths."""
    from ds4serve.llm import LLM
    from model_helpers import write_random_text_checkpoint

    write_random_text_checkpoint(tmp_path, num_hidden_layers=2, compress_ratios=[0, 0])
    outs = {mode: LLM(tmp_path, max_seqs=2, host_kernels=mode).generate([[5, 6, 7], [9] * 40], max_tokens=6,
                                                                        ignore_eos=True)
            for mode in ("on", "off")}
    assert all(len(ids) == 6 for ids in outs["off"]) and outs["on"] == outs["off"]
