"""The engine's commit / verify / rollback with a checkpoint drafter, driven by drafts that get accepted.

A random drafter (``test_checkpoint_drafting``) is almost never right, so the accepted path of the engine
barely runs there. Here the drafter is the *input*: a wrapper around the real ``DraftModel`` of an ``LLM``
(DSpark or MTP adapter: its ``commit`` and ``ready`` still run, on the real captured rows) whose block
logits come from an oracle (the engine's own ``pick`` draws the tokens and their q from those logits):

* for greedy requests, the target's own greedy continuation (from a plain run beforehand, found by the
  committed tokens and the anchor's position) with a third of the positions corrupted (a fixed hash of
  the position, so accepted runs take every length from 0 to the block), and a one-hot q: most drafts
  are accepted, most blocks have a rejected tail;
* for sampled requests, a dense q = 0.2 p + 0.8 uniform, where p is the target's own tempered
  distribution (the engine's forward and head on the committed tokens and the earlier drafts): under
  rejection sampling accepted often enough, and rejected often enough that the residual
  ``max(p - q, 0)`` decides many tokens; under coupled acceptance the stream is plain decoding's.

What is tested is the engine: greedy output equals plain decoding (one stream and six), acceptance is
high, the drafter's state is fed exactly the committed rows (also across preemptions), the confidence
threshold cuts blocks, and sampled outputs follow the target's distribution with drafts on and off (two
chi-square tests, deterministic seeds, a fixed significance). The DSpark test checkpoint is config C,
text only (no vision tower), so every prompt here is text.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
import torch

from ds4serve.llm import LLM
from ds4serve.engine.model_drafts import Block
from ds4serve.engine.sampling import SamplingParams
from ds4serve.scheduler.scheduler import QueueFull
from ds4serve.scheduler.spec import RequestSpec

from dspark_checkpoint import build_trunk, drafter_tensors, dspark_config, write_checkpoint
from mtp_checkpoint import write_mtp_checkpoint

DSPARK = {"method": "dspark", "num_speculative_tokens": 5}
MTP = {"method": "mtp", "num_speculative_tokens": 3}
ALPHA = 1e-3  # significance of the chi-square tests (their seeds are fixed: the outcome is too)
PREEMPT_POOL = 128  # tokens of paged state: two pages, for six requests of 10-30 + 60 tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("drafted")
    config = dspark_config()
    dspark = write_checkpoint(root / "dspark", build_trunk(root / "d"), drafter_tensors(config).stored, config)
    return {"dspark": dspark, "mtp": write_mtp_checkpoint(build_trunk(root / "m"), root / "mtp")}


# ------------------------------------------------------------------------------------------------
# the test drafter
@dataclass
class Held:
    """A wrapped drafter state: the real one, and every (position, token) committed into it, in order."""

    inner: object
    log: list[tuple[int, int]] = field(default_factory=list)
    seq: dict[int, int] = field(default_factory=dict)


class TestDrafter:
    """The real drafter's ``commit`` / ``ready`` (recorded), with blocks from ``oracle`` when given
    (else the real drafter's own). ``survival`` overrides the blocks' confidence products."""

    __test__ = False  # not a pytest class

    def __init__(self, inner, oracle=None, survival: tuple[float, ...] | None = None):
        self.inner, self.oracle, self.survival = inner, oracle, survival
        self.plan, self.block, self.keep_rows = inner.plan, inner.block, inner.keep_rows
        self.states: list[Held] = []
        self.owner: dict[int, str] = {}  # id(Held) -> request id, read from the engine's slots at commit
        self.drafts = None  # the ModelDrafts this wraps (set by ``install``)

    def new_state(self) -> Held:
        held = Held(self.inner.new_state())
        self.states.append(held)
        return held

    def release(self, state: Held) -> None:
        self.inner.release(state.inner)

    def commit(self, states, positions, tokens, hidden, owners) -> None:
        slots = {id(st): rid for rid, st in self.drafts._states.values()}
        for pos, tok, own in zip(positions.tolist(), tokens.tolist(), owners.tolist()):
            held = states[own]
            self.owner[id(held)] = slots[id(held)]
            held.log.append((pos, tok))
            held.seq[pos] = tok
        self.inner.commit([s.inner for s in states], positions, tokens, hidden, owners)

    def ready(self, states, last):
        return self.inner.ready([s.inner for s in states], last)

    def draft(self, states, anchors, anchor_positions, pick) -> Block:
        """The oracle's logits, one block position at a time (each may depend on the block's earlier
        tokens), through the engine's own ``pick``: the tokens and their q are the engine's draw."""
        if self.oracle is None:
            out = self.inner.draft([s.inner for s in states], anchors, anchor_positions, pick)
        else:
            drawn: list[list[int]] = [[] for _ in states]
            qs = []
            for i in range(self.block):
                logits = torch.stack([self.oracle(s, int(a), int(p), drawn[r])
                                      for r, (s, a, p) in enumerate(zip(states, anchors.tolist(),
                                                                         anchor_positions.tolist()))])
                tokens, q = pick(logits, i)
                for r, t in enumerate(tokens.tolist()):
                    drawn[r].append(t)
                qs.append(q)
            out = Block(torch.tensor(drawn), torch.stack(qs, dim=1), torch.ones(len(states), self.block))
        if self.survival is not None:
            out = Block(out.tokens, out.q, torch.tensor([self.survival] * out.tokens.shape[0]))
        return out


def install(llm: LLM, **kw) -> TestDrafter:
    drafts = llm.core.executor.drafts
    wrapper = TestDrafter(drafts.model, **kw)
    wrapper.drafts = drafts
    drafts.model = wrapper
    return wrapper


def corrupt(position: int) -> bool:
    """A fixed third of the positions, spread by a hash so accepted runs have every length (0 .. B)."""
    return hashlib.blake2b(position.to_bytes(4, "little"), digest_size=2).digest()[0] % 3 == 0


def corrupted_continuation(refs: list[list[int]], vocab: int):
    """The greedy oracle's logits: a peak at the next token of the reference sequence the committed
    tokens and the anchor are a prefix of, or the next id at a ``corrupt`` position."""

    def oracle(held: Held, anchor: int, position: int, drawn: list[int]) -> torch.Tensor:
        known = [(i, held.seq.get(i)) for i in range(position)]
        ref = next((r for r in refs if len(r) > position and r[position] == anchor
                    and all(t is None or r[i] == t for i, t in known)), [])
        x = position + 1 + len(drawn)
        token = ref[x] if x < len(ref) else 3
        token = (token + 1) % vocab if corrupt(x) else token
        return 10.0 * torch.nn.functional.one_hot(torch.tensor(token), vocab).float()

    return oracle


class TargetLaw:
    """The target's tempered next-token distribution after ``ids``: an idle ``reference`` engine's own
    forward and head (``LLM.prompt_logits(engine=True)``), cached by context."""

    def __init__(self, reference: LLM, temperature: float):
        self.reference, self.temperature = reference, temperature
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._cache:
            logits = self.reference.prompt_logits(list(key), engine=True)[-1].double()
            self._cache[key] = torch.softmax(logits / self.temperature, -1)
        return self._cache[key]


def dense_oracle(law: TargetLaw, vocab: int, exact_below: int):
    """The sampled oracle's logits: ``temperature * log q`` with q = 0.2 p + 0.8 uniform, so the engine's
    pick (the request's temperature over them) draws from q itself. p is the target's ``law`` after the
    committed tokens, the anchor and the block's earlier drafts, for anchors below ``exact_below`` and the
    first two drafts; q is uniform elsewhere (no test reads those tokens; any q keeps it exact)."""
    uniform = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)

    def oracle(held: Held, anchor: int, position: int, drawn: list[int]) -> torch.Tensor:
        q = uniform
        if position < exact_below and len(drawn) < 2:
            q = 0.2 * law([held.seq[i] for i in range(position)] + [anchor] + drawn) + 0.8 * uniform
        return (law.temperature * torch.log(q)).float()

    return oracle


# ------------------------------------------------------------------------------------------------
# running requests
def make(path, spec: dict | None, **settings) -> LLM:
    settings = {"host_kernels": "on", "warmup": False, "enable_prefix_caching": False, **settings}
    return LLM(path, speculative=json.dumps(spec) if spec else None, **settings)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [list(r.output_ids) for r in requests(llm, prompts, params)]


def requests(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Every request in one engine, as many at once as it takes (``LLM._run`` with per-request params)."""
    core = llm.core
    reqs = [core.make_request(RequestSpec(p, s)) for p, s in zip(prompts, params)]
    todo = deque(reqs)
    while todo or core.has_work:
        while todo:
            try:
                core.add(todo[0])
            except QueueFull:
                break
            todo.popleft()
        for out in core.step():
            assert out.finish_reason != "error", out.error
    return reqs


def prompts(vocab: int, n: int) -> list[list[int]]:
    """Distinct prompts with repeats inside (so plain greedy decoding has some structure to follow)."""
    out = []
    for i in range(n):
        phrase = [(11 * i + 7 * j) % (vocab - 10) + 3 for j in range(5 + i % 4)]
        out.append((phrase * 5)[: 10 + 4 * i])
    return out


def greedy(n: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * n


def check_commits(wrapper: TestDrafter, finals: dict[str, list[int]]) -> int:
    """Every drafter state was fed each position at most once, in increasing order (the engine may skip
    rows older than the drafter's ``keep_rows``), and only tokens of its request's final sequence
    (prompt + output) below its last token (which is never fed): no row of a rejected draft. Returns
    the number of rows committed."""
    rows = 0
    for held in wrapper.states:
        if not held.log:
            continue
        final = finals[wrapper.owner[id(held)]]
        positions = [p for p, _ in held.log]
        assert all(a < b for a, b in zip(positions, positions[1:])), positions
        assert positions[-1] < len(final) - 1, (positions[-1], len(final))
        assert [t for _, t in held.log] == [final[p] for p in positions]
        rows += len(positions)
    return rows


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,spec,streams", [("dspark", DSPARK, 1), ("dspark", DSPARK, 6), ("mtp", MTP, 1),
                                               ("mtp", MTP, 6)], ids=["dspark-1", "dspark-6", "mtp-1", "mtp-6"])
def test_accepted_drafts_leave_greedy_output_unchanged(checkpoints, kind, spec, streams):
    """Mostly-right drafts: most are accepted, each block's tail rejected; greedy output is plain
    decoding's, token for token, and the drafter's states hold the committed rows only."""
    plain = make(checkpoints[kind], None, max_seqs=streams)
    vocab = plain.core.cfg.vocab_size
    ps = prompts(vocab, streams)
    want = run(plain, ps, greedy(streams, 30))
    drafted = make(checkpoints[kind], spec, max_seqs=streams)
    wrapper = install(drafted, oracle=corrupted_continuation([p + w for p, w in zip(ps, want)], vocab))
    reqs = requests(drafted, ps, greedy(streams, 30))
    assert [list(r.output_ids) for r in reqs] == want
    assert check_commits(wrapper, {r.request_id: p + w for r, p, w in zip(reqs, ps, want)}) > 0
    figures = dict(drafted.core.stats.speculation)
    generated = sum(len(w) for w in want)
    assert figures["accepted_tokens"] >= 0.3 * generated, figures
    assert figures.get("accepted_at_1", 0) > 0, figures  # runs of two accepted drafts
    assert figures["drafted_tokens"] > figures["accepted_tokens"], figures  # and rejected tails
    assert drafted.core.scheduler.stats["step_failures"] == 0
    assert drafted.core.leaks() == ""


@pytest.mark.parametrize("kind,spec", [("dspark", DSPARK), ("mtp", MTP)], ids=["dspark", "mtp"])
def test_drafter_states_hold_committed_rows_only_across_preemptions(checkpoints, kind, spec):
    """A two-page pool for six requests: requests are suspended to host memory (and resumed in another
    slot, where their old block has no q: never verified) or, with a host budget too small, dropped and
    recomputed from position 0 into a fresh drafter state. Every state, fed by the real drafter's own
    blocks or the oracle's, holds each committed position once and no rejected draft; greedy output is
    still plain decoding's, and no step fails."""
    plain = make(checkpoints[kind], None, max_seqs=6)
    vocab = plain.core.cfg.vocab_size
    ps = prompts(vocab, 6)
    want = run(plain, ps, greedy(6, 60))
    for host, oracle, preempted in (("1MB", True, "preempt_suspend"), ("20KB", True, "preempt_drop"),
                                    ("1MB", False, "preempt_suspend")):
        drafted = make(checkpoints[kind], spec, max_seqs=6, kv_budget=PREEMPT_POOL, host_budget=host, step_tokens=48,
                       max_prefill_tokens=48)
        wrapper = install(drafted, oracle=corrupted_continuation([p + w for p, w in zip(ps, want)], vocab)
                          if oracle else None)
        reqs = requests(drafted, ps, greedy(6, 60))
        assert [list(r.output_ids) for r in reqs] == want
        assert check_commits(wrapper, {r.request_id: p + w for r, p, w in zip(reqs, ps, want)}) > 0
        stats = drafted.core.scheduler.stats
        assert stats[preempted] > 0 and stats["step_failures"] == 0, dict(stats)
        assert drafted.core.stats.speculation.get("drafted_tokens", 0) > 0
        assert drafted.core.leaks() == ""


def test_the_confidence_threshold_cuts_blocks(checkpoints):
    """``confidence_threshold``: a block is verified only up to where the drafter's survival estimate
    (the confidence product) stays at or above it, whatever the acceptance rate would allow."""
    plain = make(checkpoints["dspark"], None, max_seqs=3)
    vocab = plain.core.cfg.vocab_size
    ps = prompts(vocab, 3)
    want = run(plain, ps, greedy(3, 30))
    drafted = make(checkpoints["dspark"], {**DSPARK, "confidence_threshold": 0.5}, max_seqs=3)
    install(drafted, oracle=corrupted_continuation([p + w for p, w in zip(ps, want)], vocab),
            survival=(0.9, 0.6, 0.45, 0.3, 0.2))
    assert run(drafted, ps, greedy(3, 30)) == want
    figures = dict(drafted.core.stats.speculation)
    assert figures.get("drafted_at_1", 0) > 0 and figures.get("accepted_at_1", 0) > 0, figures
    assert figures.get("drafted_at_2", 0) == 0, figures


# ------------------------------------------------------------------------------------------------
# sampled outputs: the target's distribution with drafts on and off
PROMPT = [5, 17, 42, 9, 120, 77, 3, 250, 11, 64]
TEMPERATURE = 0.1  # the random target is nearly flat at 0.7; at 0.1 ~25 tokens hold most of the mass
SAMPLES = 600
WIDE = {"max_seqs": 32, "step_tokens": 512}  # room for every decoder's whole draft in every step


def chi_square_p(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def two_sample(a: list[int], b: list[int]) -> float:
    """The chi-square test that ``a`` and ``b`` come from one distribution: a bin per token seen >= 10
    times in both together, the rest pooled."""
    ca, cb = Counter(a), Counter(b)
    bins = [[t] for t in sorted(set(a) | set(b)) if ca[t] + cb[t] >= 10]
    kept = {t for (t,) in bins}
    rest = [t for t in set(a) | set(b) if t not in kept]
    if sum(ca[t] + cb[t] for t in rest) >= 10:
        bins.append(rest)
    na, nb = sum(ca[t] for g in bins for t in g), sum(cb[t] for g in bins for t in g)
    stat = 0.0
    for group in bins:
        oa, ob = sum(ca[t] for t in group), sum(cb[t] for t in group)
        for observed, size in ((oa, na), (ob, nb)):
            expected = size * (oa + ob) / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return chi_square_p(stat, len(bins) - 1)


def conditional_fit(outputs: list[list[int]], law: TargetLaw, groups: int = 5) -> float:
    """Whether each output's 2nd token follows the target's law given its 1st: per sample, the tokens of
    p(. | prompt, 1st token) sorted by mass fall in ``groups`` bands by the mass before them (band 0: the
    likeliest fifth); the observed band counts against their expected sums, with the exact covariance of
    independent categorical draws (a Wald statistic, chi-square with ``groups - 1`` degrees of freedom).
    A sampler that over- or under-draws the likely tokens of each context moves band 0 and the tail."""
    observed = torch.zeros(groups, dtype=torch.float64)
    expected = torch.zeros(groups, dtype=torch.float64)
    cov = torch.zeros(groups, groups, dtype=torch.float64)
    for out in outputs:
        p = law(PROMPT + out[:1])
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        band = torch.empty_like(order)
        band[order] = (before * groups).floor().long().clamp(max=groups - 1)
        e = torch.zeros(groups, dtype=torch.float64).index_add_(0, band, p)
        observed[band[out[1]]] += 1
        expected += e
        cov += torch.diag(e) - torch.outer(e, e)
    x = (observed - expected)[:-1]
    stat = float(x @ torch.linalg.solve(cov[:-1, :-1], x))
    return chi_square_p(stat, groups - 1)


@pytest.mark.parametrize("kind,spec", [("dspark", DSPARK), ("mtp", MTP)], ids=["dspark", "mtp"])
def test_sampled_outputs_follow_the_target_distribution(checkpoints, kind, spec):
    """``SAMPLES`` seeds, the 2nd and 3rd generated tokens (the ones drafts decide: the 1st comes from the
    prefill). Drafts are drawn from a dense q = 0.2 p + 0.8 uniform. Coupled acceptance commits plain
    decoding's own draws: the outputs equal plain decoding's, seed for seed. Rejection sampling accepts
    many drafts by the ratio test and rejects many, the token then drawn from the residual
    max(p - q, 0): its 2nd tokens follow the target's law given the 1st (``conditional_fit``; plain
    decoding's do too), and its 2nd and 3rd tokens agree with plain decoding's (two-sample tests)."""
    plain = make(checkpoints[kind], None, **WIDE)
    vocab = plain.core.cfg.vocab_size
    params = [SamplingParams(max_tokens=4, temperature=TEMPERATURE, seed=1000 + i, ignore_eos=True)
              for i in range(SAMPLES)]
    off = run(plain, [PROMPT] * SAMPLES, params)
    law = TargetLaw(plain, TEMPERATURE)
    for mode in ("coupled", "rejection"):
        drafted = make(checkpoints[kind], {**spec, "draft_share": 1.0, "acceptance": mode}, **WIDE)
        assert drafted.core.executor.drafts.rejection == (mode == "rejection")
        install(drafted, oracle=dense_oracle(law, vocab, len(PROMPT) + 2))
        on = run(drafted, [PROMPT] * SAMPLES, params)
        figures = dict(drafted.core.stats.speculation)
        assert figures["drafted_at_0"] >= SAMPLES and figures["accepted_tokens"] >= SAMPLES // 10, figures
        assert figures["drafted_tokens"] - figures["accepted_tokens"] >= SAMPLES // 5, figures  # rejections
        if mode == "coupled":
            assert on == off
            continue
        fits = {name: conditional_fit(outs, law) for name, outs in (("off", off), ("on", on))}
        agree = {i: two_sample([o[i] for o in off], [o[i] for o in on]) for i in (1, 2)}
        assert min(fits.values()) > ALPHA, fits
        assert min(agree.values()) > ALPHA, agree
