"""The checkpoint drafters in the engine (issue 28): a random DS4 checkpoint with a random DSpark drafter,
and one with a random MTP block, decode greedily exactly as without drafts, one stream and many, the
drafter really drafting (its blocks verified every step) and its states fed only committed rows."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from ds4serve.config import ConfigError
from ds4serve.llm import LLM

from dspark_checkpoint import build_trunk, drafter_tensors, dspark_config, write_checkpoint
from mtp_checkpoint import write_mtp_checkpoint


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    trunk = build_trunk(root)
    config = dspark_config()
    return write_checkpoint(root / "ckpt", trunk, drafter_tensors(config).stored, config)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return write_mtp_checkpoint(build_trunk(root), root / "ckpt")


def _prompts(vocab: int, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        phrase = [(7 * i + 13 * j) % (vocab - 10) + 3 for j in range(6 + i % 5)]
        out.append((phrase * 4)[: 9 + 3 * i])
    return out


def _compare(path, spec: dict, streams: int, host: str = "on") -> dict:
    plain = LLM(path, max_seqs=streams, host_kernels=host, warmup=False)
    drafted = LLM(path, max_seqs=streams, host_kernels=host, warmup=False, speculative=json.dumps(spec))
    prompts = _prompts(plain.core.cfg.vocab_size, streams)
    want = plain.generate(prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
    got = drafted.generate(prompts, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert got == want
    assert drafted.core.leaks() == ""
    return dict(drafted.core.stats.speculation)


@pytest.mark.parametrize("streams", [1, 6, 16])
def test_dspark_drafts_leave_greedy_output_unchanged(dspark_ckpt, streams):
    figures = _compare(dspark_ckpt, {"method": "dspark", "num_speculative_tokens": 5}, streams)
    assert figures.get("drafted_tokens", 0) > 0, figures


@pytest.mark.parametrize("streams", [1, 6, 16])
def test_mtp_drafts_leave_greedy_output_unchanged(mtp_ckpt, streams):
    figures = _compare(mtp_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, streams)
    assert figures.get("drafted_tokens", 0) > 0, figures


def test_torch_forward_drafts_too(dspark_ckpt):
    figures = _compare(dspark_ckpt, {"method": "dspark"}, 3, host="off")
    assert figures.get("drafted_tokens", 0) > 0, figures


def test_auto_runs_what_the_checkpoint_ships(dspark_ckpt, mtp_ckpt, caplog):
    caplog.set_level(logging.INFO, logger="ds4serve")
    for path, kind in ((dspark_ckpt, "dspark"), (mtp_ckpt, "mtp")):
        llm = LLM(path, max_seqs=1, warmup=False, speculative="auto")
        assert llm.core.executor.drafts is not None
        assert f"ships a {kind} drafter" in caplog.text


def test_a_method_the_checkpoint_lacks_stops_start_up(dspark_ckpt, mtp_ckpt):
    with pytest.raises(ConfigError, match="no MTP block|serial MTP|mtp"):
        LLM(dspark_ckpt, max_seqs=1, warmup=False, speculative=json.dumps({"method": "mtp"}))
    with pytest.raises(ConfigError, match="DSpark"):
        LLM(mtp_ckpt, max_seqs=1, warmup=False, speculative=json.dumps({"method": "dspark"}))


def test_the_confidence_threshold_cuts_blocks(dspark_ckpt):
    """A block is cut where the drafter's survival estimate falls below the threshold: near 1 nothing
    of a random drafter's block is verified, and the output is unchanged."""
    figures = _compare(dspark_ckpt, {"method": "dspark", "confidence_threshold": 0.999}, 2)
    assert figures.get("drafted_tokens", 0) == 0, figures


def test_a_proposal_is_cut_by_survival_and_used_only_at_its_row():
    from ds4serve.engine.sampling import SamplingParams
    from ds4serve.scheduler.drafting import DraftPolicy
    from ds4serve.scheduler.request import Request
    from ds4serve.scheduler.spec import RequestSpec

    policy = DraftPolicy(k=5, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=100, source="model", confidence=0.5)
    req = Request("r", RequestSpec(prompt_ids=(1, 2, 3), params=SamplingParams(max_tokens=20, temperature=0.0)))
    req.computed = 3
    req.proposal, req.proposal_at, req.proposal_survival = (7, 8, 9, 10), 3, (0.9, 0.7, 0.4, 0.3)
    assert policy._proposal(req, 5) == (7, 8)
    assert policy._proposal(req, 1) == (7,)
    req.computed = 4  # the request moved on: the block was drafted for another row
    assert policy._proposal(req, 5) == ()


@pytest.mark.parametrize("acceptance", ["coupled", "rejection"])
def test_seeded_sampling_with_model_drafts(dspark_ckpt, acceptance):
    """Coupled acceptance: each draft races with plain decoding's own noise for its output index, so a
    seeded request's sampled stream *is* plain decoding's, whatever was drafted and whatever the batch.
    Rejection sampling is exact in distribution only (its stream depends on the drafts): it runs, and
    decodes the same number of tokens."""
    streams = 4
    plain = LLM(dspark_ckpt, max_seqs=streams, warmup=False)
    drafted = LLM(dspark_ckpt, max_seqs=streams, warmup=False,
                  speculative=json.dumps({"method": "dspark", "acceptance": acceptance}))
    prompts = _prompts(plain.core.cfg.vocab_size, streams)
    kw = dict(max_tokens=20, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    want = plain.generate(prompts, **kw)
    got = drafted.generate(prompts, **kw)
    assert drafted.core.stats.speculation.get("drafted_tokens", 0) > 0
    if acceptance == "coupled":
        assert got == want
    else:
        assert [len(g) for g in got] == [len(w) for w in want]


def _survival_case(survival: tuple[float, ...], proposal: tuple[int, ...] = (7, 8, 9, 10, 11), rid: str = "r"):
    from ds4serve.engine.sampling import SamplingParams
    from ds4serve.scheduler.request import Request
    from ds4serve.scheduler.spec import RequestSpec

    req = Request(rid, RequestSpec(prompt_ids=(1, 2, 3), params=SamplingParams(max_tokens=50, temperature=0.0)))
    req.computed = 3
    req.proposal, req.proposal_at, req.proposal_survival = proposal, 3, survival
    return req


def _limits():
    from ds4serve.scheduler.admission import SchedulerLimits

    return SchedulerLimits(num_layers=4, max_model_len=512, step_tokens=64, max_prefill_tokens=64, min_prefill_tokens=1,
                           prefill_mode="chunked", max_queue=8)


def _expected_rate(rows: list[tuple[float, ...]], n: int, costs: tuple[float, float, float]) -> float:
    """Expected tokens per second of a step of ``n`` decoders verifying ``rows[r]`` of each block
    (written here from the objective, independently of the planner)."""
    a, b, c = costs
    taken = sum(len(r) for r in rows)
    return (n + sum(sum(r) for r in rows)) / (a + b * n + c * taken)


def test_survival_decides_how_much_of_a_model_block_is_verified():
    """A checkpoint drafter's block is verified as far as its rows raise the step's expected tokens per
    second: a confident block whole, a doubtful one cut where its estimate turns doubtful, whatever the
    request's acceptance rate (``ceil(k * rate)`` would verify 2 of each at rate 0.4)."""
    from itertools import product

    from ds4serve.scheduler.drafting import DraftPolicy

    policy = DraftPolicy(k=5, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=100, source="model")
    costs = (1e-3, 0.0, 1e-4)  # a row costs a tenth of the step: a rate of 0.4 pays beside 2 decoders
    sure = _survival_case((0.95, 0.9, 0.85, 0.8, 0.75), rid="sure")
    doubt = _survival_case((0.6, 0.3, 0.1, 0.05, 0.01), (20, 21, 22, 23, 24), rid="doubt")
    for req in (sure, doubt):
        req.draft_rate = 0.4
    got = policy.plan([sure, doubt], _limits(), costs)
    assert got["sure"] == (7, 8, 9, 10, 11)
    # the best cut by brute force over every pair of prefixes
    best = max(product(range(6), range(6)), key=lambda t: _expected_rate(
        [sure.proposal_survival[:t[0]], doubt.proposal_survival[:t[1]]], 2, costs))
    assert (len(got["sure"]), len(got.get("doubt", ()))) == best
    assert 0 < len(got["doubt"]) < 5


def test_survival_rows_take_the_budget_best_first():
    """Under a row budget the most probable rows win, across requests: each block is still a prefix."""
    from ds4serve.scheduler.drafting import DraftPolicy

    policy = DraftPolicy(k=5, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=100, source="model", share=1.0)
    a = _survival_case((0.9, 0.5, 0.4, 0.3, 0.2), rid="a")
    b = _survival_case((0.8, 0.7, 0.6, 0.1, 0.1), (30, 31, 32, 33, 34), rid="b")
    limits = dataclasses.replace(_limits(), step_tokens=6)  # 6 - 2 decoders = 4 spare rows
    got = policy.plan([a, b], limits, (1e-3, 0.0, 1e-6))
    assert got == {"a": (7,), "b": (30, 31, 32)}


def test_a_block_none_of_which_pays_counts_against_the_rate_and_a_budget_cut_does_not():
    """A block whose first row already lowers tokens per second is not verified and goes into the
    request's rate as a draft rejected at once, so a request whose blocks are never used stops asking for
    them (its drafter forward costs every step); a block left out only for want of rows is not held
    against it. (At 4 streams of the bundled model every decoder drafted a block a step and none was
    verified: the engine ran at 0.83-0.88x of plain decoding with nothing drafted.)"""
    from ds4serve.scheduler.drafting import DraftPolicy

    policy = DraftPolicy(k=5, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=100, source="model", share=1.0)
    costs = (1e-3, 0.0, 1e-4)  # beside 4 decoders a row pays above an estimate of 0.4 (a rate of 0.44)
    reqs = [_survival_case((0.35, 0.3, 0.2, 0.1, 0.05), rid=f"r{i}") for i in range(4)]
    rates = [r.draft_rate for r in reqs]
    assert policy.plan(reqs, _limits(), costs) == {}
    assert all(r.draft_rate < before for r, before in zip(reqs, rates))
    for _ in range(10):
        policy.plan(reqs, _limits(), costs)
    assert all(not policy.pays(r, 4, costs, 0.0, 512) for r in reqs)  # its rate fell below the bar
    # a budget of one spare row: the best block's first row is taken, the others wait without a mark
    cheap = (1e-3, 0.0, 1e-6)
    a, b = _survival_case((0.9, 0.8), rid="a"), _survival_case((0.8, 0.7), (30, 31), rid="b")
    before = b.draft_rate
    assert policy.plan([a, b], dataclasses.replace(_limits(), step_tokens=3), cheap) == {"a": (7,)}
    assert b.draft_rate == before


def test_a_drafter_whose_estimates_ran_high_gets_shorter_blocks():
    """The estimates are scaled by what they were worth for this request: after drafts whose accepted
    tokens fell well short of their estimates, the same block is cut earlier (and back to whole once the
    record is good again)."""
    from ds4serve.scheduler.drafting import DraftPolicy, record

    policy = DraftPolicy(k=5, min_n=1, max_n=1, window=1, max_rows=7, vocab_size=100, source="model")
    costs = (1e-3, 0.0, 2e-4)
    survival = (0.9, 0.8, 0.7, 0.6, 0.5)
    req = _survival_case(survival)
    assert len(policy.plan([req], _limits(), costs)["r"]) == 5
    for _ in range(10):
        record(req, 5, 0, sum(survival))  # nothing accepted of blocks estimated at 3.5 tokens
    assert req.survival_scale < 0.2
    assert len(policy.plan([req], _limits(), costs).get("r", ())) < 2
    for _ in range(20):
        record(req, 5, 5, sum(survival))
    assert len(policy.plan([req], _limits(), costs)["r"]) == 5


@pytest.mark.parametrize("affordable", [True, False])
def test_a_prompt_is_read_by_the_drafter_only_where_drafting_could_pay(dspark_ckpt, affordable):
    """With warm-up off the policy has no costs (every row pays): prompts are captured and committed to
    the drafter. Once no acceptance rate can pay for a drafter's block at the batch's width (a drafter
    forward priced at a second), a new prompt costs no capture, no commit and no block, and the output
    is plain decoding's."""
    llm = LLM(dspark_ckpt, max_seqs=4, host_kernels="on", warmup=False, speculative=json.dumps({"method": "dspark"}))
    core = llm.core
    if not affordable:
        core.scheduler.step_costs.block_cost = 1.0
        core.scheduler.step_costs._fitted = (1e-3, 1e-4, 1e-4)
    committed = []
    drafts = core.executor.drafts
    original = drafts.model.commit
    drafts.model.commit = lambda states, positions, *rest: (committed.append(positions.numel()),
                                                            original(states, positions, *rest))
    entries = getattr(drafts.model, "commit_entries", None)  # the native drafter's path: the backlog as it is
    if entries is not None:
        drafts.model.commit_entries = lambda got: (committed.append(sum(len(e[2]) for e in got)), entries(got))
    start = getattr(drafts.model, "start_greedy", None)  # its commit on the pool's worker (``propose_later``)
    if start is not None:
        drafts.model.start_greedy = lambda got, *rest: (committed.append(sum(len(e[2]) for e in got)),
                                                        start(got, *rest))[1]
    prompts = _prompts(core.cfg.vocab_size, 4)
    got = llm.generate(prompts, max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM(dspark_ckpt, max_seqs=4, host_kernels="on", warmup=False)
    assert got == plain.generate(prompts, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert (sum(committed) > 0) == affordable, committed
    assert (core.stats.speculation.get("drafted_tokens", 0) > 0) == affordable


def test_an_mtp_block_on_a_vision_checkpoint_stops_start_up_naming_it(tmp_path):
    """The serial MTP block is text-only (DeepSeek-V4-Flash ships it; the vision checkpoint ships DSpark):
    the bundled DS4V model with a random MTP block beside it is refused, naming the vision field."""
    import shutil

    from safetensors.torch import save_file

    from ds4serve.tiny.random_model import BUNDLED
    from mtp_checkpoint import mtp_tensors

    for f in BUNDLED.iterdir():
        if f.is_file() and f.name != "drafter.safetensors":
            shutil.copy(f, tmp_path / f.name)
    config = {k: v for k, v in json.loads((BUNDLED / "config.json").read_text()).items() if not k.startswith("dspark_")}
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    save_file({k: v.contiguous() for k, v in mtp_tensors(config, quantized=False).items()}, str(tmp_path / "mtp.safetensors"))
    for spec in ('{"method": "mtp"}', "auto"):
        with pytest.raises(ConfigError, match="vision_n_layers.*text-only"):
            LLM(tmp_path, max_seqs=2, warmup=False, speculative=spec)
