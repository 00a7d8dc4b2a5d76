"""Prefix-cache tiers (issue 30 item 1): hits from host memory and from disk are exact, survive a restart,
and damaged or foreign files are skipped, never used.

The device pool is sized for one snapshot, so every other snapshot leaves it (to host memory, or with
no host tier straight to disk). Every engine prefills in chunks of 256 tokens and the prompts share
exactly 300 tokens, so a hit is always at the interval point 256, a chunk end of the cold run: a hit
must then reproduce the cache-off engine with the same settings bit for bit (tokens and logprobs),
and a request whose snapshot is damaged must too, by missing. Greedy, fp32, small random checkpoints.
"""

from __future__ import annotations

import json
import logging
import stat

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ds4serve.cache.spilled import read_header
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.server.metrics import Metrics
from model_helpers import feed, random_ids

SNAP = 104448  # one arena entry (rings + a partial page) of random_config's layout, fp32
PAGE = 14336
ONE_SNAPSHOT = f"{SNAP + 6 * PAGE}b"  # the device pool keeps one snapshot of <= 6 pages
CHUNK = 256


def _ckpt(path, seed: int):
    """random_config (vocab 1000, text) with weights from ``seed``: same layout, different weights."""
    from safetensors.torch import save_file

    from ds4serve.config import ModelConfig
    from ds4serve.tiny.random_model import random_config, random_weights

    path.mkdir(parents=True, exist_ok=True)
    config = random_config(1000, vision=False)
    save_file(random_weights(ModelConfig.from_dict(config), seed=seed), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier-ckpts")
    return _ckpt(root / "a", 1), _ckpt(root / "b", 2)


def _llm(path, **kw):
    from ds4serve.llm import LLM

    kw.setdefault("max_prefill_tokens", CHUNK)
    return LLM(path, max_seqs=2, **kw)


def _tiered(path, **kw):
    return _llm(path, prefix_cache_budget=ONE_SNAPSHOT, **kw)


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompt families: a 300-token stem each, and two continuations of it."""
    out = []
    for g in range(n):
        stem = random_ids(300, 1000, seed=seed + g)
        out.append([stem + random_ids(20 + 5 * i, 1000, seed=seed + 100 * (g + 1) + i) for i in range(2)])
    return out


def _one(core, prompt):
    """``prompt`` alone on ``core``, greedy; the finished request."""
    req = core.make_request(RequestSpec(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                               logprobs=2)))
    feed(core, [req])
    assert core.leaks() == "", core.leaks()
    return req


def _same(a, b) -> None:
    """Bit for bit: the same tokens and the same logprobs (every reported alternative)."""
    assert a.output_ids == b.output_ids
    assert a.output_logprobs == b.output_logprobs


@pytest.fixture(scope="module")
def cold(ckpts):
    """Cache-off engines with the same chunking: what every request must answer."""
    return [_llm(p, enable_prefix_caching=False).core for p in ckpts]


def test_hits_come_back_from_host_memory(ckpts, cold):
    """Three families through a one-snapshot pool: the stems' snapshots at 256 spill to host memory and
    the second continuation of each family hits there, answering what the cold engine answers."""
    core = _tiered(ckpts[0], prefix_cache_host_bytes="64MB").core
    fams = _prompts(3, seed=10)
    for fam in fams:
        _one(core, fam[0])
    got = [_one(core, fam[1]) for fam in fams]
    stats = core.prefix_stats()
    assert [r.cached_tokens for r in got] == [256, 256, 256]
    assert stats["host_hits"] >= 3 and stats["evictions"] > 0 and stats["host_evictions"] == 0, stats
    assert core.stats.prefix["host_hits"] == stats["host_hits"]  # in the published EngineStats, and scraped:
    metrics = Metrics("m")
    metrics.read_engine(lambda: core.stats)
    scraped = {(s.name, s.labels.get("tier")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert scraped["ds4serve_prefix_cache_tier_hits_total", "host"] == stats["host_hits"]
    assert scraped["ds4serve_prefix_cache_tier_bytes", "host"] == stats["host_bytes"] > 0
    assert scraped["ds4serve_prefix_cache_tier_hits_total", "disk"] == 0
    for r, fam in zip(got, fams):
        _same(r, _one(cold[0], fam[1]))
    big = _llm(ckpts[0]).core  # the device hit of an engine whose pool keeps everything: the same bits
    for fam, r in zip(fams, got):
        _one(big, fam[0])
        _same(_one(big, fam[1]), r)
    assert core.reset_prefix_cache() > 0 and core.prefix_stats()["host_snapshots"] == 0


def test_hits_come_back_from_disk_and_survive_a_restart(ckpts, cold, tmp_path):
    """No host tier: what leaves the pool is written to the directory; hits are read back from the
    files (the writer flushed first), files are private, and a new engine on the same directory hits."""
    root = tmp_path / "cache"
    core = _tiered(ckpts[0], prefix_cache_host_bytes=0, prefix_cache_dir=str(root)).core
    fams = _prompts(2, seed=40)
    for fam in fams:
        _one(core, fam[0])
    core.cache.prefix.tiers.disk.flush()
    files = sorted(root.iterdir())
    assert files and stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [oct(f.stat().st_mode) for f in files]
    first = _one(core, fams[0][1])
    assert first.cached_tokens == 256 and core.prefix_stats()["disk_hits"] >= 1, core.prefix_stats()
    _same(first, _one(cold[0], fams[0][1]))
    core.close()  # persists the pool's snapshots too
    again = _tiered(ckpts[0], prefix_cache_host_bytes=0, prefix_cache_dir=str(root)).core
    assert again.prefix_stats()["disk_snapshots"] >= len(files)
    got = [_one(again, fam[1]) for fam in fams]
    assert [r.cached_tokens for r in got] == [256, 256]
    assert again.prefix_stats()["disk_hits"] >= 2
    for r, fam in zip(got, fams):
        _same(r, _one(cold[0], fam[1]))
    again.close()


def test_host_then_disk(ckpts, cold, tmp_path):
    """A host tier of one snapshot in front of the disk: older spills move on to the files, and the
    hits come from both tiers with the cold answers."""
    core = _tiered(ckpts[0], prefix_cache_host_bytes=f"{SNAP + 5 * PAGE}b", prefix_cache_dir=str(tmp_path)).core
    fams = _prompts(3, seed=70)
    for fam in fams:
        _one(core, fam[0])
    core.cache.prefix.tiers.disk.flush()
    got = [_one(core, fam[1]) for fam in reversed(fams)]
    stats = core.prefix_stats()
    assert [r.cached_tokens for r in got] == [256, 256, 256], stats
    assert stats["host_evictions"] > 0 and stats["disk_hits"] >= 1, stats
    for r, fam in zip(got, reversed(fams)):
        _same(r, _one(cold[0], fam[1]))
    core.close()


def _by_position(root, position: int) -> dict[str, object]:
    """Files of snapshots at ``position``, by the hex key they hold."""
    out = {}
    for f in root.iterdir():
        with open(f, "rb") as fh:
            meta, _ = read_header(fh)
        if meta["position"] == position:
            out[meta["key"]] = f
    return out


def test_damaged_and_foreign_files_are_skipped(ckpts, cold, tmp_path, caplog):
    """Two checkpoints of one layout fill their own directories; then in A's: one file is corrupted,
    one truncated, one overwritten by B's file of the same prefix and one of B's files is copied in
    under its own name. A restarted engine on A answers every request exactly as the cold engine
    does (the intact family still hits), and the log names each skipped file."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    fams = _prompts(4, seed=90)
    for path, root in zip(ckpts, dirs):
        core = _tiered(path, prefix_cache_host_bytes=0, prefix_cache_dir=str(root)).core
        for fam in fams:
            _one(core, fam[0])
        core.close()
    mine, theirs = _by_position(dirs[0], 256), _by_position(dirs[1], 256)
    keys = sorted(mine)
    assert len(keys) == 4 and sorted(theirs) == keys  # same tokens: same keys, other names
    corrupt, short, swapped, intact = (mine[k] for k in keys)
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0x55
    corrupt.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:-1000])
    swapped.write_bytes(theirs[keys[2]].read_bytes())
    foreign = dirs[0] / theirs[keys[3]].name
    foreign.write_bytes(theirs[keys[3]].read_bytes())
    caplog.set_level(logging.WARNING, logger="ds4serve.cache.disk_tier")
    core = _tiered(ckpts[0], prefix_cache_host_bytes=0, prefix_cache_dir=str(dirs[0])).core
    family = dict(zip(keys, _order(fams, keys)))
    got = {k: _one(core, fams[family[k]][1]) for k in keys}
    for k in keys:
        _same(got[k], _one(cold[0], fams[family[k]][1]))
    assert [got[k].cached_tokens for k in keys] == [0, 0, 0, 256]  # only the intact file is used
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    for f in (corrupt, short, swapped, foreign):
        assert sum(str(f) in m for m in skipped) == 1, (f, skipped)
    assert core.prefix_stats()["disk_skipped_files"] == 4
    gone = {f for f in (corrupt, short, swapped, foreign) if any(str(f) in m and "(deleted)" in m for m in skipped)}
    assert gone == {corrupt, short}  # damaged files of this model go; another model's are left alone
    core.close()
    fp = core.cache.prefix.tiers.config.fingerprint
    for f in (corrupt, short, swapped):  # the misses stored their prefixes again: valid files of this model
        with open(f, "rb") as fh:
            assert read_header(fh)[0]["fingerprint"] == fp
    with open(foreign, "rb") as fh:
        assert read_header(fh)[0]["fingerprint"] != fp


def _order(fams, keys) -> list[int]:
    """Family index of each key (the key of a family's 256-token stem, unsalted)."""
    from ds4serve.cache.prefix_keys import PrefixKeys

    def key(fam):
        ids = fam[0]
        return PrefixKeys("", lambda lo, hi: ids[lo:hi]).key(256).hex()

    index = {key(f): i for i, f in enumerate(fams)}
    return [index[k] for k in keys]


def test_tier_settings_are_checked():
    """Sizes in bytes (plain numbers are bytes); anything else names the setting."""
    from ds4serve.config import ConfigError
    from ds4serve.runtime.tier_setup import tier_config
    from ds4serve.settings import EngineSettings

    for bad in ("lots", "64k", -1):
        with pytest.raises(ConfigError, match="prefix_cache_host_bytes"):
            EngineSettings(prefix_cache_host_bytes=bad)
    cfg = tier_config(EngineSettings(prefix_cache_host_bytes="2MiB", prefix_cache_disk_bytes=4096), "fp")
    assert (cfg.host_bytes, cfg.disk_dir, cfg.disk_bytes) == (2 * 2**20, None, 4096)
    assert 0 < tier_config(EngineSettings(), "fp").host_bytes <= 2**30
    assert 0 < tier_config(EngineSettings(), "fp", torch.device("cuda")).host_bytes <= 2**30
    # a CPU pool is host memory already: no second cache there unless asked for
    assert tier_config(EngineSettings(), "fp", torch.device("cpu")).host_bytes == 0
    assert tier_config(EngineSettings(prefix_cache_host_bytes="2MiB"), "fp", torch.device("cpu")).host_bytes == 2**21


def test_a_directory_that_cannot_be_one_is_named(tmp_path):
    from ds4serve.config import ConfigError
    from ds4serve.runtime.tier_setup import tier_config
    from ds4serve.settings import EngineSettings

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="prefix_cache_dir"):
        tier_config(EngineSettings(prefix_cache_dir=str(tmp_path / "file")), "fp")


def _image_chat(core, tok, question: str):
    from ds4serve.chat import render_chat
    from ds4serve.multimodal.pipeline import ImagePipeline
    from image_helpers import image_url

    text = "Look at this picture carefully and remember every shape in it. " * 5
    parts = [{"type": "image_url", "image_url": {"url": image_url(3)}}, {"type": "text", "text": text + question}]
    prepared = ImagePipeline.for_engine(core, tok).prepare(render_chat(tok, [{"role": "user", "content": parts}]))
    return prepared.ids, prepared.images


def test_an_image_prefix_comes_back_from_host_memory(random_ckpt):
    """Keys hold the image's content hash: the second question about the same picture hits the
    snapshot at 256 (past the image block) from host memory, the image is not encoded again, and the
    answer is bit for bit the one a device hit gives on an engine whose pool keeps everything."""
    from ds4serve.chat import Tokenizer
    from ds4serve.llm import LLM

    tok = Tokenizer(random_ckpt)
    big = LLM(random_ckpt, max_seqs=2, max_prefill_tokens=CHUNK).core
    layout = big.cache.layout
    budget = big.cache.prefix.arena.bytes_each() + 6 * layout.bytes_per_page()
    core = LLM(random_ckpt, max_seqs=2, max_prefill_tokens=CHUNK, prefix_cache_budget=f"{budget}b",
               prefix_cache_host_bytes="64MB").core
    first = _image_chat(core, tok, "What colour is the circle?")
    second = _image_chat(core, tok, "How many shapes are there?")
    assert first[1][0].span.end < 256 < len(second[0]) < 6 * layout.page_tokens
    runs = {}
    for name, c in (("tiered", core), ("device", big)):
        r = c.make_request(RequestSpec(first[0], _greedy(), images=first[1]))
        feed(c, [r])
        encoded = c.encoder.encoded
        runs[name] = c.make_request(RequestSpec(second[0], _greedy(), images=second[1]))
        feed(c, [runs[name]])
        assert c.encoder.encoded == encoded and c.leaks() == ""
    assert runs["tiered"].cached_tokens == runs["device"].cached_tokens == 256
    assert core.prefix_stats()["host_hits"] >= 1, core.prefix_stats()
    _same(runs["tiered"], runs["device"])


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
