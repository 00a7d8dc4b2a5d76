"""The time-calibrated step budget (runtime/calibrate.py): a fixed table, and the scheduler keeps to it."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.runtime.calibrate import budget_table
from ds4serve.scheduler.admission import SchedulerLimits
from model_helpers import random_ids


@given(a=st.floats(1e-4, 0.1), b=st.floats(0, 0.01), c=st.floats(1e-6, 0.01), stall=st.floats(1.1, 4.0),
       n_max=st.integers(1, 64), floor=st.integers(1, 32), step=st.integers(64, 1024))
def test_budget_table_keeps_steps_under_the_stall_and_within_the_token_caps(a, b, c, stall, n_max, floor, step):
    table = budget_table(a, b, c, stall, n_max, floor, step)
    assert len(table) == n_max + 1 and table[0] == step
    for n in range(1, n_max + 1):
        p = table[n]
        assert p >= floor
        assert p <= max(floor, step - n)
        if p > floor:  # above the progress floor, the modelled step stays within the stall
            assert a + b * n + c * p <= stall * (a + b * n) * (1 + 1e-9)
        if n > 1 and table[n - 1] > floor and table[n - 1] < step - n:
            assert p >= table[n - 1]  # more decoders, a longer normal step: never a smaller budget


def test_limits_use_the_table_and_fall_back_to_tokens():
    lim = SchedulerLimits(num_layers=4, max_model_len=100, step_tokens=256, max_prefill_tokens=64,
                          min_prefill_tokens=8, prefill_mode="chunk", max_queue=4)
    assert lim.prefill_tokens(16) == 240
    lim = dataclasses.replace(lim, prefill_tokens_at=(256, 30, 40))
    assert lim.prefill_tokens(1) == 30 and lim.prefill_tokens(2) == 40 and lim.prefill_tokens(5) == 251


def test_a_server_core_calibrates_and_prefill_beside_decoders_keeps_to_the_table(llm_factory):
    llm = llm_factory("A", max_seqs=4, max_prefill_tokens=128, step_tokens=200, max_stall=1.5)
    core = llm.core
    table = core.limits.prefill_tokens_at
    assert len(table) == 5 and all(core.limits.min_prefill_tokens <= p <= 200 - n for n, p in enumerate(table) if n)
    assert core.scheduler.limits is core.limits
    forced = dataclasses.replace(core.limits, prefill_tokens_at=(200, 24, 24, 24, 24))
    core.limits = core.scheduler.limits = forced
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    core.add(core.make_request(RequestSpec(random_ids(5, 1000, seed=1), params)))
    while not core.history or core.history[-1].decode_rows == 0:
        core.step()
    core.history.clear()
    core.add(core.make_request(RequestSpec(random_ids(150, 1000, seed=2), params)))
    core.run_until_idle()
    mixed = [h for h in core.history if h.decode_rows and h.prefill_rows]
    assert mixed and max(h.prefill_rows for h in mixed) <= 24
    assert core.leaks() == ""
