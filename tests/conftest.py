"""Shared fixtures: tiny reference checkpoints built with transformers (fp32, seeded)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# property tests are deterministic: the same examples on every run and machine
settings.register_profile("ds4serve", derandomize=True, deadline=None)
settings.load_profile("ds4serve")

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import CONFIGS, make_checkpoint  # noqa: E402

torch.set_num_threads(int(os.environ.get("DS4SERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """``ckpt_factory(name)`` -> (hf_model, checkpoint dir), built once per session."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = make_checkpoint(name, tmp_path_factory.mktemp(f"ckpt-{name}"))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def llm_factory(ckpt_factory):
    """``llm_factory(name, **settings)`` -> ds4serve ``LLM`` on that checkpoint (cached per settings)."""
    from ds4serve.llm import LLM

    cache: dict[tuple, object] = {}

    def get(name: str, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            _, path = ckpt_factory(name)
            cache[key] = LLM(path, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="module", params=["on", "off"], ids=["host-on", "host-off"])
def host_kernels(request) -> str:
    """``EngineSettings.host_kernels`` for a suite that must hold on both forwards: "on" is the native
    host forward a CPU serves with, "off" the torch forward CUDA GPUs run. Never "auto": under auto a
    native forward that disagrees with torch at start-up quietly falls back to torch, so a regression
    in it would pass as the torch path. Module-scoped so a module's cached engines and solo references
    are built once per mode; a test comparing two runs builds both in this one mode."""
    return request.param


def pytest_collection_modifyitems(config, items):
    assert CONFIGS  # the registry must not be empty


@pytest.fixture(scope="session")
def random_ckpt(tmp_path_factory):
    """The random placeholder DS4 checkpoint (byte tokenizer), generated into a temp dir."""
    from ds4serve.tiny.random_model import ensure_random_checkpoint

    return ensure_random_checkpoint(tmp_path_factory.mktemp("random-ckpt"))


@pytest.fixture(scope="session")
def server(random_ckpt):
    """One shared server for tests that do not change its settings."""
    from server_harness import serve

    with serve(random_ckpt, settings={"max_seqs": 40, "max_queue": 64}) as srv:
        yield srv
