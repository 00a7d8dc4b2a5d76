"""Sampling with per-request state, batched over the rows of one step.

Every request carries a ``SamplerState``: its parameters, the token history penalties look at,
and its own RNG (seeded from the request's seed), so a request's seed decides only its own tokens,
whatever else is in the batch. Greedy rows take the argmax. Random rows draw exactly one vector of
exponential noise per token from their own generator (the "exponential race", equivalent to a
categorical draw), so their token stream does not depend on the batch either.

Order of processing (as vLLM's v1 sampler): ``logit_bias`` added to the raw logits (one batched
scatter-add over the rows that carry one) -> penalties -> suppress EOS/stop ids under ``min_tokens``
-> grammar mask (``constraints.py``; rows with a grammar only) -> temperature -> top-k -> top-p ->
min-p -> draw. Logprobs are reported from the raw model distribution (before the bias), as vLLM's
default ``raw_logprobs`` and OpenAI do.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from .constraints import constrain


class SamplingError(ValueError):
    """Invalid sampling parameters (user input)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the sampled token's logprob plus the top n
    # vLLM's prompt_logprobs: None, or n >= 0: every prompt token's logprob (but the first's) plus the top n,
    # computed in the prefill steps (``engine.prompt_scoring``); such a prompt never starts from a cache hit
    prompt_logprobs: int | None = None
    # thinking budget: past this many output tokens still inside the reasoning, only </think> may come
    # (needs a constraint that knows the reasoning state; see constraints.py)
    max_reasoning_tokens: int | None = None
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the raw logits, ids distinct
    logit_bias: tuple[tuple[int, float], ...] = ()
    # logit_bias split once (``_check_bias``), so a step concatenates tuples instead of walking pairs
    bias_ids: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    bias_values: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks = [
            # 0: score the prompt only (prompt logprobs, echo): the request ends after its prefill
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 10, "repetition_penalty must be in (0, 10]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (self.max_reasoning_tokens is None or self.max_reasoning_tokens >= 0,
             "max_reasoning_tokens must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SamplingError(msg)
        self._check_bias()

    def _check_bias(self) -> None:
        """The server checks ids against the vocabulary; here what no vocabulary makes valid is refused,
        so a direct ``LLM`` caller gets the same rules (a duplicate id would add its bias twice)."""
        ids = [t for t, _ in self.logit_bias]
        for t, b in self.logit_bias:
            if t < 0:
                raise SamplingError(f"logit_bias token id {t} is negative")
            if not (math.isfinite(b) and -100 <= b <= 100):
                raise SamplingError(f"logit_bias for token {t} is {b}; it must be in [-100, 100]")
        if len(set(ids)) != len(ids):
            raise SamplingError("logit_bias names a token id twice")
        object.__setattr__(self, "bias_ids", tuple(ids))
        object.__setattr__(self, "bias_values", tuple(float(b) for _, b in self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


@dataclass
class SamplerState:
    """Per-request sampling state; the engine reads it and draws from ``rng`` only.

    The random stream is *counter-based*: the draw for output token ``k`` uses a generator seeded
    from (the request's base seed, ``k``), never a generator that carries state from earlier draws.
    So a step that fails after drawing, a suspend, a drop and recompute, or a retry of the same token
    draws exactly the same token again: nothing about randomness has to be undone.
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: list[int]  # shared with the request: the scheduler appends accepted tokens
    eos_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = field(default=None, repr=False)
    base_seed: int | None = field(default=None, repr=False)  # the seed, or one drawn once per request
    # grammar state (constraints.Constraint, e.g. chat.grammar_runtime.RequestMatcher) or None: free
    constraint: Any = field(default=None, repr=False)
    # a draft row's state (``drafted.row_states``): the last ``drafted`` of ``output_ids`` are draft tokens
    # under verification, not committed output (a grammar may refuse them: that row is then never read)
    drafted: int = 0

    def rng(self, device: torch.device) -> torch.Generator:
        """The generator for the next output token (re-seeded for token ``len(output_ids)``)."""
        if self.generator is None or self.generator.device != torch.device(device):
            self.generator = torch.Generator(device=device)
        if self.base_seed is None:
            self.base_seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator.manual_seed(token_seed(self.base_seed, len(self.output_ids)))
        return self.generator

    def banned_ids(self) -> tuple[int, ...]:
        """Ids that may not be sampled yet (EOS and stop ids before ``min_tokens``)."""
        if len(self.output_ids) >= self.params.min_tokens:
            return ()
        return tuple(self.params.stop_token_ids) + (() if self.params.ignore_eos else tuple(self.eos_ids))


def token_seed(base: int, index: int) -> int:
    """A well-mixed 63-bit seed for output token ``index`` of a request seeded ``base`` (splitmix64)."""
    z = (base * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


@dataclass(frozen=True)
class Draw:
    token: int
    ok: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    error: str | None = None


NONFINITE = "the model produced non-finite logits for this request"


def sample_rows(logits: torch.Tensor, states: Sequence[SamplerState]) -> list[Draw]:
    """Sample one token per row of ``logits [N, V]`` (fp32) with each row's own state."""
    n, vocab = logits.shape
    if n == 0:
        return []
    fast = _greedy_draws(logits, states)
    if fast is not None:
        return fast
    finite = torch.isfinite(logits).all(dim=-1)
    logits = torch.where(finite.unsqueeze(-1), logits, torch.zeros_like(logits))
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in states) else None
    penalised = _apply_penalties(apply_bias(logits, states), states)
    work = constrain(_ban(penalised, states), states)
    if any(s.constraint is not None for s in states):  # a grammar allowing only what min_tokens bans (EOS)
        dead = ~torch.isfinite(work).any(dim=-1)
        if bool(dead.any()):  # sync-ok: constrained steps only
            work = torch.where(dead.unsqueeze(-1), constrain(penalised, states), work)
    tokens = torch.argmax(work, dim=-1)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(work.index_select(0, idx), [states[i].params for i in random_rows])
        drawn = torch.stack([_race(probs[j], states[i].rng(logits.device)) for j, i in enumerate(random_rows)])
        tokens = tokens.index_copy(0, idx, drawn)
    return _collect(tokens, finite, raw_logprobs, states)


def _plain_greedy(s: SamplerState) -> bool:
    """A row whose draw is the argmax of its raw logits: greedy, no logprobs, bias, penalties, grammar or
    banned ids (``min_tokens``)."""
    p = s.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and not p.penalised and s.constraint is None
            and not s.banned_ids())


def _greedy_draws(logits: torch.Tensor, states: Sequence[SamplerState]) -> list[Draw] | None:
    """``sample_rows``'s draws where every row is plain greedy (``_plain_greedy``) over host fp32 logits:
    each finite row's argmax (the first largest value, ``torch.argmax``'s rule and numpy's), in three numpy
    calls where the general path makes ~8 torch ops (~50 us of a ~0.5 ms decode step of the bundled model,
    each small op 5-15 us beside a forward). None where it does not apply."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not all(_plain_greedy(s) for s in states):
        return None
    x = logits.detach().numpy()
    finite = np.isfinite(x).all(axis=1).tolist()
    tokens = x.argmax(axis=1).tolist()
    return [Draw(token=t, ok=True) if f else Draw(token=-1, ok=False, error=NONFINITE)
            for t, f in zip(tokens, finite)]


def apply_bias(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias``: one ``index_put_`` (accumulating) over every biased row.

    Ids at or past this vocabulary (a padded or smaller head than the tokenizer; the server refuses
    them first) add 0 at column 0 rather than indexing out of range, without a host sync."""
    rows = [i for i, s in enumerate(states) if s.params.logit_bias]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    params = [states[i].params for i in rows]
    counts = torch.tensor([len(p.bias_ids) for p in params], device=dev)
    row_idx = torch.repeat_interleave(torch.tensor(rows, device=dev), counts)
    cols = torch.tensor(list(chain.from_iterable(p.bias_ids for p in params)), dtype=torch.long, device=dev)
    vals = torch.tensor(list(chain.from_iterable(p.bias_values for p in params)), dtype=logits.dtype, device=dev)
    inside = cols < vocab
    out = logits.clone()
    out.index_put_((row_idx, torch.where(inside, cols, 0)), torch.where(inside, vals, 0), accumulate=True)
    return out


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    rows = [i for i, s in enumerate(states) if s.params.penalised]
    if not rows:
        return logits
    n, vocab = logits.shape
    out = logits.clone()
    dev = logits.device
    for i in rows:  # per request, not per layer: penalties need each request's own history
        p = states[i].params
        hist = torch.tensor(list(states[i].output_ids), dtype=torch.long, device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(list(states[i].prompt_ids) + list(states[i].output_ids), dtype=torch.long, device=dev)
            seen = seen[(seen >= 0) & (seen < vocab)]
            vals = out[i].index_select(0, seen)
            vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            out[i].index_copy_(0, seen, vals)
        if hist.numel() and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(hist[(hist >= 0) & (hist < vocab)], minlength=vocab).to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def _ban(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    banned = [(i, b) for i, s in enumerate(states) for b in s.banned_ids() if 0 <= b < logits.shape[1]]
    if not banned:
        return logits
    out = logits.clone()
    rows = torch.tensor([i for i, _ in banned], device=logits.device)
    cols = torch.tensor([b for _, b in banned], device=logits.device)
    out[rows, cols] = float("-inf")
    return out


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(-1)
    scaled = logits / temp
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).unsqueeze(-1)
    drop = ranks >= top_k
    probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(-1)
    before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted  # mass strictly above each token
    drop |= before >= top_p  # keep the smallest prefix whose mass reaches top_p (always the top token)
    min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(-1)
    drop |= probs_sorted < min_p * probs_sorted[:, :1]
    drop[:, 0] = False
    kept = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    return torch.zeros_like(kept).scatter_(1, order, kept)


def _race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) is a draw from p (one noise vector per token, per request)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.argmax(probs / noise)


def _collect(tokens, finite, raw_logprobs, states) -> list[Draw]:
    tokens_l = tokens.tolist()
    finite_l = finite.tolist()
    lp = top = None
    if raw_logprobs is not None:
        lp = raw_logprobs.gather(1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        k = max((s.params.logprobs or 0) for s in states)
        if k:
            tv, ti = torch.topk(raw_logprobs, k, dim=-1)
            top = (tv.tolist(), ti.tolist())
    out = []
    for i, s in enumerate(states):
        if not finite_l[i]:
            out.append(Draw(token=-1, ok=False, error=NONFINITE))
            continue
        n_top = s.params.logprobs
        if n_top is None or lp is None:
            out.append(Draw(token=tokens_l[i], ok=True))
            continue
        tops = tuple(zip(top[1][i][:n_top], top[0][i][:n_top])) if (top and n_top) else ()
        out.append(Draw(token=tokens_l[i], ok=True, logprob=lp[i], top_logprobs=tops))
    return out
