"""Tensor / expert parallel pieces that need no second process: the shard arithmetic, per-rank
loading (only a rank's slices, only its experts read), the per-rank capacity plan against the shard
really loaded, and the cache-call mirror that keeps every rank's cache bookkeeping identical."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.cache import StateLayout
from ds4serve.cache.manager import CacheManager
from ds4serve.cache.prefix_keys import PrefixKeys
from ds4serve.config import ConfigError, ModelConfig
from ds4serve.engine.parallel_executor import CallRecorder, Mirrored, Replayer
from ds4serve.model import load_model
from ds4serve.model.packed import PackedExperts
from ds4serve.model.sharding import ShardPlan
from ds4serve.model.checkpoint import Source as _Source
from ds4serve.runtime.capacity import plan_capacity, plan_weights
from ds4serve.tiny.random_model import BUNDLED
from test_capacity import ROUTED, _flash
from test_packed_experts import _checkpoint


@settings(max_examples=60, deadline=None)
@given(world=st.sampled_from([1, 2, 4, 8]), part=st.integers(1, 9), halves=st.sampled_from([1, 2]))
def test_rank_ranges_split_every_index_exactly_once(world, part, halves):
    size = world * part * halves
    name = ".mlp.experts.gate_up_proj" if halves == 2 else ".self_attn.q_b_proj.weight"
    seen = []
    for rank in range(world):
        ranges = ShardPlan(rank, world).ranges(name, size)
        if world == 1:
            assert ranges is None
            return
        assert len(ranges) == halves and all(b - a == part for a, b in ranges)
        seen += [i for a, b in ranges for i in range(a, b)]
    assert sorted(seen) == list(range(size))
    if halves == 2:  # rank r holds the same rows of the gate half and of the up half
        first = ShardPlan(0, world).ranges(name, size)
        assert first[1][0] - first[0][0] == size // 2


def test_plans_say_what_does_not_divide():
    cfg = ModelConfig.from_file(BUNDLED)  # 4 heads, 2 output groups, 4 experts
    assert ShardPlan(0, 2).problems(cfg) == []
    problems = ShardPlan(0, 3, expert_parallel=True).problems(cfg)
    assert any("attention heads (4)" in p for p in problems) and any("routed experts (4)" in p for p in problems)
    with pytest.raises(ConfigError, match="not divisible"):
        plan_capacity(cfg, torch.float32, 2**30, 512, tensor_parallel=3)


def _named(model) -> dict[str, object]:
    out = dict(model.state_dict())
    for i, layer in enumerate(model.model.layers):
        for n in ("gate_up_proj", "down_proj"):
            out[f"model.layers.{i}.mlp.experts.{n}"] = getattr(layer.mlp.experts, n)
    return out


@pytest.mark.parametrize("fmt,ep,packed", [("mxfp4", False, False), ("mxfp4", True, False), ("mxfp4", True, True),
                                          ("fp8", False, False)])
def test_each_rank_loads_its_slices_and_reads_only_its_experts(ckpt_factory, tmp_path, monkeypatch, fmt, ep, packed):
    d = _checkpoint(ckpt_factory, tmp_path, fmt)
    cfg, full = load_model(d, progress=False)
    whole = _named(full)
    read: list[str] = []
    get = _Source.get
    monkeypatch.setattr(_Source, "get", lambda self, name: read.append(name) or get(self, name))
    for rank in range(2):
        plan = ShardPlan(rank, 2, ep)
        read.clear()
        _, part = load_model(d, progress=False, shard=plan, packed_experts=packed, vision=False)
        for name, t in _named(part).items():
            want = plan.take(name, whole[name])
            got = t.take(torch.arange(t.n_experts)) if isinstance(t, PackedExperts) else t
            assert torch.equal(got, want), name
        assert part.model.layers[0].self_attn.n_heads == cfg.num_heads // 2
        if ep:  # whole experts: the other rank's are never read from the checkpoint
            per = cfg.n_routed_experts // 2
            theirs = {j for j in range(cfg.n_routed_experts) if not rank * per <= j < (rank + 1) * per}
            touched = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
            assert touched and not touched & theirs, (rank, touched)


@pytest.mark.parametrize("ep", [False, True])
def test_per_rank_plan_matches_the_shard_really_loaded(ep):
    cfg = ModelConfig.from_file(BUNDLED)
    for rank in range(2):
        plan = ShardPlan(rank, 2, ep)
        _, model = load_model(BUNDLED, progress=False, shard=plan, vision=rank == 0)
        tensors = list(model.state_dict().values())
        if rank == 0:
            tensors += list(model.vision_encoder.state_dict().values())
        real = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())
        planned = plan_weights(cfg, torch.float32, shard=plan).total
        assert abs(planned - real) <= 0.05 * real, (rank, planned, real)


@pytest.mark.parametrize("n,ep", [(2, True), (4, True), (8, False), (8, True)])
def test_flash_routed_bytes_per_rank_follow_the_formula(n, ep):
    w = plan_weights(_flash(), torch.bfloat16, packed_experts=True, shard=ShardPlan(0, n, ep))
    want = ROUTED * 4.25 / 8 / n
    assert abs(w.routed_packed - want) <= 0.02 * want


def test_flash_plan_says_how_many_devices_it_needs():
    from ds4serve.runtime.capacity import render_plan

    one = plan_capacity(_flash(), torch.bfloat16, 141 * 2**30, 65536)
    assert not one.fits and "needs --tensor-parallel-size >= 4" in render_plan(one)  # bf16 experts: 516 GiB
    two = plan_capacity(_flash(), torch.bfloat16, 141 * 2**30, 65536, packed_experts=True, tensor_parallel=2,
                        expert_parallel=True)
    assert two.fits and "per rank of 2" in render_plan(two)


def _cache(cfg: ModelConfig) -> CacheManager:
    layout = StateLayout.build(cfg, torch.float32)
    return CacheManager(layout, 4, 40, "cpu", host_budget_bytes=1 << 24, staging_rows=32,
                        prefix_budget_bytes=1 << 20)


def _fingerprint(cache: CacheManager) -> tuple:
    pages = cache.state.pages
    tables = tuple(tuple(pages.table(s)) for s in range(cache.n_slots))
    prefix = cache.prefix
    return (tuple(cache._free_slots), tuple(cache._gen), tables, cache.host_used, pages.free_pages,
            tuple(sorted(prefix.holds().items())), prefix.snapshots, tuple(prefix._free))


@pytest.mark.parametrize("seed", range(6))
def test_a_mirrored_cache_and_its_replay_make_the_same_decisions(seed):
    cfg = ModelConfig.from_file(BUNDLED)
    rec = CallRecorder()
    real, other = _cache(cfg), _cache(cfg)
    mirror, replay = Mirrored(real, "cache", rec), Replayer(other)
    rng = random.Random(seed)
    live: dict[int, tuple] = {}  # slot handle -> (keys, tokens)
    parked = []
    prompts = [[rng.randrange(50) for _ in range(200)] for _ in range(3)]  # shared prefixes: lookups hit
    hits = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.25:
            slot = mirror.alloc_slot()
            if slot is not None:
                ids = rng.choice(prompts)
                keys = PrefixKeys("", lambda lo, hi, ids=ids: ids[lo:hi])
                hit = mirror.prefix.lookup(keys, 150)
                if hit is not None and not mirror.prefix.attach(hit, slot):
                    hit = None
                hits += hit is not None
                live[slot] = (keys, hit.position if hit else 0)
        elif op < 0.55 and live:
            slot = rng.choice(list(live))
            keys, n = live[slot]
            n2 = min(190, n + rng.randrange(1, 80))
            if mirror.reserve({slot: n2}):
                live[slot] = (keys, n2)
                if n2 >= 64 and rng.random() < 0.5:
                    mirror.prefix.store(keys, n2, slot)
        elif op < 0.7 and live:
            slot = rng.choice(list(live))
            del live[slot]
            mirror.drop(slot)
        elif op < 0.85 and live:
            slot = rng.choice(list(live))
            snap = mirror.suspend(slot, live[slot][1])
            if snap is not None:
                parked.append((snap, live.pop(slot)))
        elif parked:
            snap, entry = parked.pop(rng.randrange(len(parked)))
            slot = mirror.restore(snap)
            if slot is None:
                parked.append((snap, entry))
            else:
                live[slot] = entry
        replay.apply(pickle.loads(pickle.dumps(rec.take())))  # as the calls travel to a worker
        assert _fingerprint(real) == _fingerprint(other)
    assert real.prefix.stats.stored > 0 and hits > 0, "the scenario never stored or reused a prefix snapshot"
