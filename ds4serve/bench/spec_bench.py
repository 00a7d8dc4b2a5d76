"""``ds4serve bench spec``: decode tok/s with and without speculative drafts, and acceptance per position.

Two engines on the same checkpoint, one plain and one with ``--speculative-config`` (default: n-gram
drafts of up to 5 tokens), generate the same greedy batches at each concurrency, in interleaved rounds
(the rates shown are the best round's: on a shared machine the noise only ever slows a round down; the
ratios are the median over rounds of each round's pair, the two engines' runs back to back, so a machine
whose speed drifts between rounds moves both sides of a ratio alike). Each prompt is a
seeded random phrase repeated, the shape of text edited in place, where prompt lookup finds its
matches. Per concurrency it reports the decode rates and their ratio (each request's tokens after its
first over its time from first to last token, summed over the requests: what drafting speeds up; the
prompt's prefill is the same work in both engines), the end-to-end rates' ratio (prefill included),
the drafted and accepted
tokens, the acceptance at each draft position and the mean acceptance length (tokens committed per
verify step, the bonus included), and whether the outputs were identical (they must be: verification
is exact). With ``--requests-per-stream R`` each stream sends R prompts one after another, the next as
soon as the one before finished, as clients of a server do; with one (the default) a concurrency level
is one batch, whose end-to-end time is its slowest request's: drafting that lets the others finish early
gains nothing there, which a server that refills the freed slots does gain. With more than one, read the
end-to-end ratio: the plain engine's streams stay in lockstep (every answer is the same length, so they
finish on the same step and the next prompts prefill together, before anybody decodes), where drafts
take the streams out of step and each prompt then prefills beside the other streams' decoding, inside
their decode time (at 4 streams of the bundled model with n-gram drafts: 62-78 steps carrying a prompt
against 20-24, and a decode ratio ~0.1 below the end-to-end one). Both engines do the same work; only
where the decode metric's clock runs differs.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..llm import LLM

TINY = Path(__file__).resolve().parents[2] / "models" / "ds4v-tiny"
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@dataclass(frozen=True)
class SpecRow:
    streams: int
    plain_tok_s: float  # decode: per request, tokens after the first over its first-to-last time; summed
    spec_tok_s: float
    plain_e2e_tok_s: float  # end to end: every token over the whole call, the prompt's prefill included
    spec_e2e_tok_s: float
    drafted: int
    accepted: int
    verify_steps: int
    acceptance_by_position: tuple[float, ...]
    identical: bool

    ratio: float = 0.0  # decode: the median over rounds of each round's drafts / plain (rounds paired)
    e2e_ratio: float = 0.0  # the same of the end-to-end rates

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step: the accepted drafts plus the target's own token."""
        return 1 + self.accepted / self.verify_steps if self.verify_steps else 0.0


def prompts(n: int, vocab: int, length: int = 240, phrase: int = 60, seed: int = 0) -> list[list[int]]:
    """``n`` prompts, each a seeded random phrase of ``phrase`` ids repeated to ``length``."""
    out = []
    for i in range(n):
        rnd = random.Random(seed * 1000 + i)
        words = [rnd.randrange(100, vocab) for _ in range(phrase)]
        out.append((words * (length // phrase + 1))[:length])
    return out


def _timed(llm: LLM, streams: list[list[list[int]]], new_tokens: int
           ) -> tuple[tuple[float, float], list[list[int]], Counter]:
    """``((decode tok/s, end-to-end tok/s), outputs, speculation counters)`` of greedy closed-loop streams:
    each stream sends its prompts one after another, the next as soon as the one before it finished
    (``LLM.generate_timed``'s ``stream_of``). One prompt a stream is one batch whose wall time is its
    slowest request's; more prompts a stream measure a server that refills the slots early finishers free."""
    before = Counter(llm.core.stats.speculation)
    flat = [p for s in streams for p in s]
    t = time.perf_counter()
    outs, times = llm.generate_timed(flat, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                     stream_of=[i for i, s in enumerate(streams) for _ in s])
    elapsed = time.perf_counter() - t
    decode = sum((new_tokens - 1) / max(last - first, 1e-9) for first, last in times)
    return (decode, len(outs) * new_tokens / elapsed), outs, Counter(llm.core.stats.speculation) - before


def _row(c: int, plain: list[tuple[float, float]], spec: list[tuple[float, float]], figures: Counter,
         identical: bool) -> SpecRow:
    drafted_at = [figures[f"drafted_at_{i}"] for i in range(16) if figures[f"drafted_at_{i}"]]
    by_pos = tuple(figures[f"accepted_at_{i}"] / n for i, n in enumerate(drafted_at))
    return SpecRow(c, max(r[0] for r in plain), max(r[0] for r in spec), max(r[1] for r in plain),
                   max(r[1] for r in spec), figures["drafted_tokens"], figures["accepted_tokens"],
                   figures["verify_steps"], by_pos, identical,
                   ratio=statistics.median(s[0] / p[0] for p, s in zip(plain, spec)),
                   e2e_ratio=statistics.median(s[1] / p[1] for p, s in zip(plain, spec)))


def measure(model: Path, streams: Sequence[int], new_tokens: int, rounds: int, speculative: dict,
            per_stream: int = 1, **settings) -> list[SpecRow]:
    """The figures per concurrency (see the module docstring); ``per_stream``: prompts each stream sends
    one after another (``_timed``); ``settings`` go to both engines."""
    max_seqs = max(streams)
    plain = LLM(model, max_seqs=max_seqs, **settings)
    spec = LLM(model, max_seqs=max_seqs, speculative=json.dumps(speculative), **settings)
    vocab = plain.core.cfg.vocab_size
    rows = []
    for c in streams:
        every = prompts(c * per_stream, vocab)
        batch = [every[i::c] for i in range(c)]
        rates: dict[str, list[tuple[float, float]]] = {"plain": [], "spec": []}
        figures, identical = Counter(), True
        for _ in range(rounds):
            p_rate, p_out, _ = _timed(plain, batch, new_tokens)
            s_rate, s_out, got = _timed(spec, batch, new_tokens)
            rates["plain"].append(p_rate)
            rates["spec"].append(s_rate)
            figures += got
            identical &= p_out == s_out
        rows.append(_row(c, rates["plain"], rates["spec"], figures, identical))
    return rows


def render(rows: Sequence[SpecRow], speculative: dict, per_stream: int = 1) -> str:
    lines = [f"speculative decoding: {json.dumps(speculative)} (greedy; tok/s: the best round, ratios: the median "
             "of the rounds' pairs; decode tok/s: each "
             "request's tokens after its first over the time after it, summed; end to end: prefill included; "
             f"{per_stream} prompt(s) a stream, one after another)",
             "| streams | plain decode tok/s | drafts decode tok/s | ratio | end-to-end ratio | drafted | accepted "
             "| mean acceptance length | acceptance by position | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " / ".join(f"{a:.2f}" for a in r.acceptance_by_position) or "-"
        lines.append(f"| {r.streams} | {r.plain_tok_s:.1f} | {r.spec_tok_s:.1f} | {r.ratio:.2f}x "
                     f"| {r.e2e_ratio:.2f}x | {r.drafted} | {r.accepted} | {r.mean_acceptance_length:.2f} | {pos} "
                     f"| {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def run(model: Path | None = None, streams: Sequence[int] = (1, 4, 16), new_tokens: int = 128, rounds: int = 3,
        speculative: dict | None = None, json_path: Path | None = None, per_stream: int = 1,
        **settings) -> list[SpecRow]:
    spec = speculative or NGRAM
    rows = measure(model or TINY, streams, new_tokens, rounds, spec, per_stream, **settings)
    print(render(rows, spec, per_stream))
    if json_path is not None:
        Path(json_path).write_text(json.dumps([asdict(r) | {"mean_acceptance_length": r.mean_acceptance_length}
                                               for r in rows], indent=2))
    return rows
