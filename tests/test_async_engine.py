"""EngineLoop: the engine loop in its own thread behind an asyncio API."""

from __future__ import annotations

import asyncio

import pytest

from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.runtime import EngineLoop
from ds4serve.runtime import assemble_core
from ds4serve.scheduler.scheduler import RequestTooLarge
from model_helpers import random_ids


@pytest.fixture()
def async_engine(llm_factory):
    llm = llm_factory("A", max_seqs=6, max_model_len=512)
    core = assemble_core(llm.cfg, llm.model, llm.core.settings, llm.device, eos_ids=())
    eng = EngineLoop(core).start()
    yield eng, llm
    eng.shutdown()


async def _collect(eng, rid, prompt, params, stop_after=None):
    toks = []
    async for out in eng.generate(RequestSpec(prompt, params), rid):
        toks.extend(out.new_token_ids)
        if stop_after is not None and len(toks) >= stop_after:
            break  # leaving the iterator aborts the request
        if out.finished:
            return toks, out.finish_reason
    return toks, "left"


def test_concurrent_streams_and_disconnects(async_engine):
    eng, llm = async_engine
    prompts = [random_ids(n, 1000, seed=900 + n) for n in (3, 40, 77, 5, 120, 16, 9, 60)]
    params = SamplingParams(max_tokens=12, temperature=0)

    async def main():
        jobs = [_collect(eng, f"r{i}", p, params, stop_after=3 if i in (1, 4) else None)
                for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    solo = [llm.generate([p], max_tokens=12)[0] for p in prompts]
    for i, (toks, reason) in enumerate(results):
        if i in (1, 4):
            assert reason == "left" and toks == solo[i][:len(toks)]
        else:
            assert reason == "length" and toks == solo[i]
    assert eng.call(lambda core: core.leaks()) == ""
    assert eng.call(lambda core: core.scheduler.stats["aborted"]) == 2


def test_rejects_before_the_stream_opens(async_engine):
    eng, _ = async_engine

    async def main():
        async for _ in eng.generate(RequestSpec(list(range(500)), SamplingParams(max_tokens=100)), "big"):
            pass

    with pytest.raises(RequestTooLarge, match="context limit"):
        asyncio.run(main())


def test_shutdown_answers_waiting_clients(llm_factory):
    llm = llm_factory("A", max_seqs=2)
    core = assemble_core(llm.cfg, llm.model, llm.core.settings, llm.device, eos_ids=())
    eng = EngineLoop(core).start()

    async def main():
        async def one(i):
            spec = RequestSpec([5, 6, 7], SamplingParams(max_tokens=400, temperature=0))
            outs = [o async for o in eng.generate(spec, f"s{i}")]
            return outs[-1]

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.sleep(0.3)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

    finals = asyncio.run(main())
    assert all(f.finished for f in finals)
    assert any(f.finish_reason == "error" and "shutting down" in (f.error or "") for f in finals)
