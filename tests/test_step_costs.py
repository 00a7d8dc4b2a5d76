"""The online fit of a decode step's cost (``scheduler/step_costs.py``) that speculative decoding's cost
rule reads: it recovers the costs the steps really have, leans on the calibrated prior while the steps
say little, and turns drafting off where the observed draft rows cost more than they yield."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.admission import SchedulerLimits
from ds4serve.scheduler.drafting import FOLLOW_LIMIT, PROBE_EVERY, DraftPolicy, worth
from ds4serve.scheduler.request import Request
from ds4serve.scheduler.spec import RequestSpec
from ds4serve.scheduler.step_costs import REFIT_EVERY, WINDOW, StepCosts

costs_ = st.tuples(st.floats(1e-5, 1e-2), st.floats(1e-6, 1e-3), st.floats(1e-6, 1e-3))


@given(costs_, st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_the_fit_recovers_noiseless_costs(true, seed):
    rnd = random.Random(seed)
    model = StepCosts()  # no prior: the steps alone
    a, b, c = true
    for _ in range(WINDOW):
        n, d = rnd.randint(1, 32), rnd.randint(0, 40)
        model.observe(n, d, a + b * n + c * d)
    assert model.costs() == pytest.approx(true, rel=1e-6, abs=1e-12)


def test_the_prior_holds_until_the_steps_vary():
    prior = (3e-4, 4e-5, 2e-5)
    model = StepCosts(prior)
    for _ in range(REFIT_EVERY - 1):
        model.observe(4, 8, 1.0)  # absurdly slow, but not yet a fit
    assert model.costs() == prior
    alone = StepCosts()
    for _ in range(2 * REFIT_EVERY):
        alone.observe(4, 8, 1e-3)  # one shape only: the system has no unique answer, nothing is fitted
    assert alone.costs() == ()


def test_observed_costs_outweigh_a_wrong_prior():
    """Calibration timed the forward alone (cheap draft rows); the whole step says a draft row costs 100 us."""
    model = StepCosts((2.9e-4, 4.3e-5, 2.4e-5))
    true = (4.5e-4, 1.1e-4, 1.0e-4)
    rnd = random.Random(0)
    for _ in range(WINDOW):
        n, d = rnd.randint(1, 16), rnd.randint(0, 30)
        model.observe(n, d, true[0] + true[1] * n + true[2] * d)
    a, b, c = model.costs()
    assert c == pytest.approx(true[2], rel=0.1) and b == pytest.approx(true[1], rel=0.1)


def test_a_negative_fit_is_clamped_and_bad_observations_ignored():
    model = StepCosts()
    for i in range(REFIT_EVERY * 2):
        n, d = 1 + i % 4, i % 3
        model.observe(n, d, 1e-3 - 1e-5 * d)  # draft rows "save" time: noise, clamped to 0
        model.observe(0, 3, 5.0)  # no decoders: not a decode step
        model.observe(2, 1, float("nan"))
    a, b, c = model.costs()
    assert c == 0.0 and a == pytest.approx(1e-3) and b == pytest.approx(0.0, abs=1e-12)


def test_the_learnt_costs_turn_drafting_off_at_width_and_keep_it_on_alone():
    """The rule of ``worth`` over the learnt costs: an acceptance rate of 0.5 pays for one stream and
    not for 16 when a draft row costs 100 us beside a 2.2 ms step (the bundled model's figures)."""
    learnt = (4.5e-4, 1.1e-4, 1.0e-4)
    assert worth(1, learnt) < 0.5 < worth(16, learnt)
    calibrated = (2.9e-4, 4.3e-5, 2.4e-5)  # the forward alone: draft rows look cheap
    policy = DraftPolicy(k=4, min_n=1, max_n=3, window=512, max_rows=7, vocab_size=1000)
    limits = SchedulerLimits(num_layers=2, max_model_len=512, step_tokens=256, max_prefill_tokens=64,
                             min_prefill_tokens=16, prefill_mode="chunk", max_queue=8, step_costs=calibrated)
    assert policy.plan(_decoders(16, 0.5), limits)  # the calibrated forward's figures: drafts
    assert policy.plan(_decoders(16, 0.5), limits, learnt, step=1) == {}  # the step's real costs: none
    assert policy.plan(_decoders(1, 0.5), limits, learnt, step=1) == {"r0": (1, 2)}  # alone it still pays


def _decoders(n: int, rate: float) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(f"r{i}", RequestSpec(prompt_ids=(1, 2, 3, 1, 2, 3, 1, 2), params=SamplingParams(max_tokens=50, temperature=0.0)))
        r.output_ids.append(3)
        r.draft_rate = rate
        out.append(r)
    return out


def test_a_drafter_forward_that_costs_more_than_it_saves_stops_drafting_blocks():
    """A checkpoint drafter's block costs its forward whether or not it is verified (here 4 rows of a block
    verified: the policy reads seconds per verified row): with the bundled
    model's figures (a 0.5 ms step, a 2.3 ms draft) no acceptance rate pays for one stream, so no block
    is drafted, not even for a probe, and the request's rows are not captured (``follows``); a drafter
    whose bar is below 1 but above the request's rate drafts only when a probe is due; a cheap drafter
    keeps drafting."""
    from ds4serve.scheduler.step_costs import StepCosts

    costs = (4.5e-4, 1.1e-4, 1.0e-4)
    policy = DraftPolicy(k=4, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=1000, source="model")
    req = _decoders(1, 0.9)[0]
    assert worth(1, costs, 2.3e-3 / 4) > 1 > 0.9 > worth(1, costs, 2e-5)
    assert policy.wants_block(req, 1, costs, 2e-5 / 4, 512)
    assert not policy.pays(req, 1, costs, 2.3e-3 / 4, 512)
    assert policy.follows(req, 1, costs, 2e-5 / 4, 512) and not policy.follows(req, 1, costs, 2.3e-3 / 4, 512)
    due = [policy.wants_block(req, 1, costs, 2.3e-3 / 4, 512, step) for step in range(2 * PROBE_EVERY)]
    assert sum(due) == 0  # no rate can pay: no probe either
    # a drafter that would need a rate past FOLLOW_LIMIT to pay is not followed at all (following costs
    # every step); below it, some rate could pay (the bar: worth's break-even with drafting.MARGIN on it),
    # not this one's: it probes
    assert FOLLOW_LIMIT < policy.bar(req, 1, costs, 1.5e-3 / 4, 512) < 1
    assert not policy.follows(req, 1, costs, 1.5e-3 / 4, 512)
    req.draft_rate = 0.5
    assert 0.5 < policy.bar(req, 1, costs, 0.8e-3 / 4, 512) < FOLLOW_LIMIT
    assert policy.follows(req, 1, costs, 0.8e-3 / 4, 512) and not policy.pays(req, 1, costs, 0.8e-3 / 4, 512)
    due = [policy.wants_block(req, 1, costs, 0.8e-3 / 4, 512, step) for step in range(2 * PROBE_EVERY)]
    assert sum(due) == 2 and due[PROBE_EVERY - 1]  # only before a probe step
    ngram = DraftPolicy(k=4, min_n=1, max_n=3, window=512, max_rows=7, vocab_size=1000)
    assert not ngram.wants_block(req, 1, costs, 0.0, 512)  # n-gram proposals cost no drafter forward
    running = StepCosts(costs)
    running.observe_blocks(2e-3, 4)
    running.observe_blocks(4e-3, 4)
    assert running.block_cost == pytest.approx(0.9 * 5e-4 + 0.1 * 1e-3)
    # seconds per verified row, from one prior block verified in 4 rows and the decayed sums
    assert running.draft_cost == pytest.approx((0.98 * 2e-3 + 4e-3 + running.block_cost) / 4)
    running.observe_blocks(2e-3, 4, verified=5)
    spent = 0.98 ** 2 * 2e-3 + 0.98 * 4e-3 + 2e-3
    assert running.draft_cost == pytest.approx((spent + running.block_cost) / (5 + 4))


def test_drafting_steps_that_cost_more_than_their_rows_are_charged_what_they_cost():
    """The bundled model at 4 streams (measured): plain steps 1.07 ms at 1 decoder and 2.47 ms at 4,
    drafting steps 4.14 ms at 4 decoders with 5-6 draft rows. The joint fit charged a draft row 0.12 ms and
    kept drafting at a 0.62 acceptance rate where it ran at 0.81x; fitted apart, a row costs what the
    steps say (~0.3 ms), and with the drafter's ~0.18 ms per verified row the bar passes 0.62."""
    model = StepCosts((2.9e-4, 1.5e-4, 5e-5))  # the forward's calibration: cheap draft rows
    rnd = random.Random(1)
    for i in range(WINDOW):
        if i % 3 == 0:
            n = rnd.choice((1, 4))
            model.observe(n, 0, 0.6e-3 + 0.467e-3 * n)
        else:  # a drafting step: 0.9 ms of its own (verification, per request) and 0.13 ms a draft row
            d = rnd.randint(1, 8)
            model.observe(4, d, 2.47e-3 + 0.9e-3 + 0.13e-3 * d)
    a, b, c = model.costs()
    assert a == pytest.approx(0.6e-3, rel=0.1) and b == pytest.approx(0.467e-3, rel=0.1)  # the prior pulls a little
    # the excess over the plain line is a cost per drafting step and one per row, each recovered
    assert c == pytest.approx(0.13e-3, rel=0.1) and model.per_draft == pytest.approx(0.9e-3, rel=0.1)
    extra = 0.18e-3 + model.per_draft / 4  # the drafter's seconds a row, and the step's per-draft cost over k rows
    assert worth(4, (a, b, c), extra) > 0.62 > worth(1, (a, b, c), extra)


def test_a_cost_per_drafting_step_is_not_charged_to_its_rows():
    """One stream of the bundled model (measured): a drafting step costs ~0.3 ms beyond a plain one however
    many rows it verifies, and ~0.06 ms a row. Fitted as a row cost alone, a row cost 0.09 ms while blocks
    were 3.5 rows long and 0.4 ms once they were 1.5: the cost rule cut blocks shorter, rows looked dearer
    still, and drafting switched itself off at 0.7-0.93x. Fitted as ``c D + e k``, neither depends on the
    blocks' length."""
    a, c, e = 0.6e-3, 0.06e-3, 0.3e-3
    for lengths in ((3, 4, 4), (1, 1, 2)):
        model = StepCosts((0.5e-3, 0.0, 0.05e-3))
        rnd = random.Random(5)
        for i in range(WINDOW):
            d = 0 if i % 4 == 0 else rnd.choice(lengths)
            model.observe(1, d, (a + c * d + e) * (1 + 0.02 * rnd.random()) if d else a * (1 + 0.02 * rnd.random()))
        got = model.costs()
        assert got[0] + got[1] == pytest.approx(a, rel=0.05)
        assert got[2] == pytest.approx(c, rel=0.3) and model.per_draft == pytest.approx(e, rel=0.1)


def test_drafts_all_the_same_length_are_charged_by_the_row():
    """Where every draft has the same rows a step's cost cannot tell a row's from a draft's: the excess is
    then a cost per row, exact for those steps (and no cost per draft is invented)."""
    model = StepCosts((0.5e-3, 0.0, 0.05e-3))
    for i in range(WINDOW):
        model.observe(1, 0 if i % 4 == 0 else 4, 0.6e-3 if i % 4 == 0 else 0.6e-3 + 0.54e-3)
    assert model.per_draft == 0.0 and model.costs()[2] == pytest.approx(0.54e-3 / 4, rel=0.05)


def test_stalled_steps_do_not_charge_the_draft_rows():
    """Another job on the cores stalls a step now and then, and drafting steps, the longer ones, more
    often. Least squares weighs a stall by its square: a few stalls among one stream's drafting steps
    charged a draft row twice its cost and drafting went off where it paid. The fit leaves out the steps
    that took over ``SPIKE`` times their fitted cost and recovers the steady costs."""
    from ds4serve.scheduler.step_costs import SPIKE

    a, c = 0.66e-3, 0.12e-3
    model = StepCosts((0.8e-3, 0.1e-3, 0.06e-3))
    rnd = random.Random(3)
    for i in range(WINDOW):
        d = 0 if i % 4 == 0 else rnd.randint(2, 4)
        t = a + c * d
        if d and i % 13 == 1:  # a stalled drafting step
            t *= 3 * SPIKE
        model.observe(1, d, t)
    assert model.costs()[2] == pytest.approx(c, rel=0.1)
    assert model.costs()[0] + model.costs()[1] == pytest.approx(a, rel=0.1)
    steady = StepCosts()
    shapes = [(rnd.randint(1, 4), rnd.choice((0, 0, 1, 2, 3, 4))) for _ in range(2 * WINDOW)]
    for i, (n, d) in enumerate(shapes):  # a machine that got 4x slower for good is not a spike for long
        steady.observe(n, d, (1 if i < WINDOW // 2 else 4) * (a + 0.1e-3 * n + c * d))
    assert steady.costs() == pytest.approx((4 * a, 4 * 0.1e-3, 4 * c), rel=1e-6)


def test_a_stalled_drafter_forward_counts_as_a_slow_one_no_more():
    from ds4serve.scheduler.step_costs import BLOCK_DECAY, SPIKE

    running = StepCosts()
    running.observe_blocks(1e-3, 2)
    running.observe_blocks(1.0, 2)  # stalled for a second
    assert running.block_cost == pytest.approx(BLOCK_DECAY * 5e-4 + (1 - BLOCK_DECAY) * SPIKE * 5e-4)


def test_a_probe_verifies_a_drafter_block_by_its_survival():
    """A request whose acceptance rate fell below the bar drafts a block only before a probe step; the
    block's forward is spent by then, so the probe verifies the rows its survival estimates pay for,
    as any block, not a single token (which also charged that whole forward to one verified row)."""
    costs = (0.66e-3, 0.0, 0.12e-3)
    policy = DraftPolicy(k=4, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=1000, source="model")
    limits = SchedulerLimits(num_layers=2, max_model_len=512, step_tokens=256, max_prefill_tokens=64,
                             min_prefill_tokens=16, prefill_mode="chunk", max_queue=8, step_costs=costs)
    req = _decoders(1, 0.1)[0]
    assert not policy.pays(req, 1, costs, 0.1e-3, 512)
    req.proposal, req.proposal_at, req.proposal_survival = (11, 12, 13, 14), req.computed, (0.9, 0.8, 0.7, 0.05)
    assert policy.plan([req], limits, costs, 0.1e-3, step=1) == {}  # not a probe step
    assert policy.plan([req], limits, costs, 0.1e-3, step=PROBE_EVERY) == {"r0": (11, 12, 13)}


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8), st.integers(1, 32), costs_,
       st.floats(0.0, 1e-3), st.integers(0, 4 * PROBE_EVERY), st.floats(0.0, 1e-3))
@settings(max_examples=80, deadline=None)
def test_the_turns_of_a_step_are_each_requests_turn(rates, n, costs, draft_cost, step, per_draft):
    """``DraftPolicy.turns`` (the bar worked out once a step) answers what ``turn`` answers per request."""
    reqs = _decoders(len(rates), 0.0)
    for r, rate in zip(reqs, rates):
        r.draft_rate = rate
    for source in ("model", "ngram"):
        policy = DraftPolicy(k=4, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=1000, source=source)
        assert policy.turns(reqs, n, costs, draft_cost, step, per_draft=per_draft) == [
            policy.turn(r, n, costs, draft_cost, 512, step, per_draft) for r in reqs]


def test_a_block_opens_with_the_prefix_that_pays_for_its_draft():
    """With a cost per drafting step (``per_draft``), a block is verified when its rows together pay for it:
    a confident block whole, a doubtful one not at all (its first row alone paid for its row cost, not for
    the draft's), and a refused block counts against the request's rate."""
    costs, per_draft = (0.6e-3, 0.0, 0.06e-3), 0.3e-3
    policy = DraftPolicy(k=4, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=1000, source="model")
    limits = SchedulerLimits(num_layers=2, max_model_len=512, step_tokens=256, max_prefill_tokens=64,
                             min_prefill_tokens=16, prefill_mode="chunk", max_queue=8, step_costs=costs)

    def asking(survival):
        req = _decoders(1, 0.9)[0]
        req.proposal, req.proposal_at, req.proposal_survival = (11, 12, 13, 14), req.computed, survival
        return req

    assert policy.plan([asking((0.9, 0.8, 0.7, 0.6))], limits, costs, 0.0, step=1, per_draft=per_draft) == {
        "r0": (11, 12, 13, 14)}
    weak = asking((0.3, 0.1, 0.05, 0.02))
    assert policy.plan([weak], limits, costs, 0.0, step=1) == {"r0": (11,)}  # by its row cost alone the first pays
    before = weak.draft_rate
    assert policy.plan([weak], limits, costs, 0.0, step=1, per_draft=per_draft) == {}
    assert weak.draft_rate < before  # refused: into its rate, as a draft stopped at once
    # a block whose first row is doubtful but whose run pays opens with the run, not with nothing
    assert policy.plan([asking((0.45, 0.45, 0.45, 0.45))], limits, costs, 0.0, step=1, per_draft=per_draft) == {
        "r0": (11, 12, 13, 14)}


def test_a_server_that_always_drafts_times_a_plain_step_now_and_then():
    """``baseline``: one step in ``BASELINE_EVERY`` runs without drafts while the window holds fewer than
    ``BASELINE_MIN`` plain steps of the step's width, and none once it holds them."""
    from ds4serve.scheduler.step_costs import BASELINE_EVERY, BASELINE_MIN

    model = StepCosts((0.7e-3, 0.11e-3, 0.06e-3))
    due = [s for s in range(4 * BASELINE_EVERY) if model.baseline(16, s)]
    assert due == [BASELINE_EVERY // 2 + k * BASELINE_EVERY for k in range(4)]
    for _ in range(BASELINE_MIN):
        model.observe(16, 0, 2.2e-3)
    assert not any(model.baseline(16, s) for s in range(4 * BASELINE_EVERY))
    assert model.baseline(4, BASELINE_EVERY // 2)  # another width is not known yet


def test_timed_plain_steps_outweigh_a_wrong_calibration_at_their_width():
    """The calibration said 2.5 ms for 16 decoders where a plain step takes 2.2; a server drafting on
    every step but its baseline steps learns the 2.2 (the prior's corner fades as real steps come)."""
    prior = (0.7e-3, 0.1125e-3, 0.06e-3)  # 0.7 + 16 * 0.1125 = 2.5 ms
    model = StepCosts(prior)
    rnd = random.Random(2)
    for i in range(WINDOW):
        if i % 16 == 8:
            model.observe(16, 0, 2.2e-3)
        else:
            d = rnd.randint(18, 30)
            model.observe(16, d, 2.2e-3 + 0.085e-3 * d)
    a, b, c = model.costs()
    assert a + 16 * b == pytest.approx(2.2e-3, rel=0.03)
    assert c == pytest.approx(0.085e-3, rel=0.1)


def test_the_priors_corners_fade_as_real_steps_of_their_kind_come():
    from ds4serve.scheduler.step_costs import BASELINE_MIN, PRIOR_WEIGHT

    model = StepCosts((0.7e-3, 0.1125e-3, 0.06e-3))
    assert model._prior_weight(16, 0) == model._prior_weight(16, 20) == PRIOR_WEIGHT
    for i in range(BASELINE_MIN):
        model.observe(16, 0, 2.2e-3)
        assert model._prior_weight(16, 0) == pytest.approx(PRIOR_WEIGHT * (1 - (i + 1) / BASELINE_MIN))
    assert model._prior_weight(16, 20) == model._prior_weight(1, 0) == PRIOR_WEIGHT  # other kinds, other widths
    for _ in range(BASELINE_MIN // 2):
        model.observe(4, 12, 1.5e-3)
    assert model._prior_weight(None, 12) == pytest.approx(PRIOR_WEIGHT / 2)  # drafting steps of any width


def test_the_loops_work_between_steps_counts_in_a_steps_cost():
    from ds4serve.scheduler.step_costs import GAP_MAX

    model = StepCosts((0.5e-3, 0.1e-3, 0.05e-3))
    model.observe_gap(0.15e-3)
    model.observe_gap(GAP_MAX * 10)  # the loop idle, waiting for requests: not a cost
    assert model.gap == pytest.approx(0.15e-3)
    assert model.costs() == pytest.approx((0.65e-3, 0.1e-3, 0.05e-3))


def test_a_request_whose_rings_cannot_catch_up_is_not_followed():
    """A step no checkpoint drafter captures leaves the decoders' positions out of its rings, which are whole
    again only ``follow_window`` positions later: a request that ends before that is not followed (nor asked
    for blocks) whatever the bar, one with room to catch up is, and one with no gap always is."""
    costs = (0.6e-3, 0.0, 0.05e-3)
    policy = DraftPolicy(k=4, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=1000, source="model",
                         follow_window=128)
    req = _decoders(1, 0.9)[0]  # an 8-token prompt, 50 tokens at most: positions up to 57
    assert policy.turns([req], 1, costs, 0.0, 1) == [(True, True)] and policy.follows(req, 1, costs, 0.0, 512)
    req.unfollowed_at = 10
    assert policy.turns([req], 1, costs, 0.0, 1) == [(False, False)]
    assert policy.turn(req, 1, costs, 0.0, 512, 1) == (False, False)
    roomy = Request("r9", RequestSpec(prompt_ids=(1, 2, 3), params=SamplingParams(max_tokens=400, temperature=0.0)))
    roomy.output_ids.append(3)
    roomy.draft_rate, roomy.unfollowed_at = 0.9, 10
    assert policy.turns([roomy], 1, costs, 0.0, 1) == [(True, True)]
    unknown = DraftPolicy(k=4, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=1000, source="model")
    assert unknown.turns([req], 1, costs, 0.0, 1) == [(True, True)]  # no window known: the bar alone decides


@pytest.mark.parametrize("prior_scale", [0.8, 1.0, 1.25])
def test_a_window_without_drafting_steps_keeps_the_calibrated_row_cost(prior_scale):
    """No drafting step was timed, so nothing measured a draft row: its cost stays the calibration's (scaled as
    the plain steps are to the calibration), wherever the calibrated line lies against the plain steps. The
    joint fit gave the prior's drafting corners' distance from the plain steps' line instead: 0.05 ms a row
    became 0.23 with a calibration a quarter high, and drafting was priced out by a cost no draft had shown."""
    prior = (0.4e-3 * prior_scale, 0.1e-3 * prior_scale, 0.05e-3)
    model = StepCosts(prior)
    rnd = random.Random(0)
    for i in range(WINDOW):
        n = 4 if i % 32 else rnd.choice([1, 2, 3])
        model.observe(n, 0, (0.35e-3 + 0.1e-3 * n) * rnd.uniform(0.95, 1.05))
    a, b, c = model.costs()
    assert a + 4 * b == pytest.approx(0.75e-3, rel=0.05)
    assert c == pytest.approx(0.05e-3 * 0.75 / (prior_scale * 0.8), rel=0.1)


def test_the_fitted_costs_are_plain_floats():
    """The fit runs on numpy arrays; what it hands the policy is Python floats (a numpy scalar leaking out
    of the plain line's weighted mean turned every bar into numpy arithmetic)."""
    model = StepCosts((0.4e-3, 0.1e-3, 0.05e-3))
    rnd = random.Random(3)
    for i in range(WINDOW):
        n = rnd.randint(1, 8)
        d = rnd.randint(1, 12) if i % 3 else 0
        model.observe(n, d, 0.4e-3 + 0.1e-3 * n + 0.06e-3 * d + (0.1e-3 if d else 0.0), min(n, 1 + d // 4) if d else 0)
    assert all(type(x) is float for x in (*model.costs(), model.per_draft)), (model.costs(), model.per_draft)
