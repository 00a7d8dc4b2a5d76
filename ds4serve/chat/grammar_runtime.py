"""Grammar-constrained decoding at run time: compiled grammars, per-request matchers, batch bitmasks.

Built on llguidance, chosen over xgrammar by measurement (16 matchers, CPU, replaying valid
answers; 129k-token byte-level BPE): mean mask fill per step for all 16 rows 0.9-2.6 ms (xgrammar
0.8-1.5 ms) but a bounded tail (xgrammar reached 100+ ms per step on JSON strings with escapes, and
7 ms mean on random string content), 2-20 ms to compile a schema (xgrammar ~150 ms, on the request
path), Lark with embedded ``%json`` for the DSML grammar, and one 3 MB abi3 wheel with no
dependencies (xgrammar requires torch, transformers and a 250 MB triton wheel).
``ds4serve.bench.grammar_bench`` measures it. The sampler's contract, one decode step::

    bitmask = compiler.allocate_bitmask(batch)          # once, [B, ceil(V/32)] int32 (CPU, pinned on CUDA)
    fill_bitmasks(matchers, bitmask)                    # row b: allowed tokens of request b (all ones: free)
    apply_bitmask(logits, bitmask)                      # one vectorised op over [B, V] (any device)
    ... sample ...
    matcher.accept(token_id)                            # per request, after the token is final
    matcher.rollback(n)                                 # when the engine undoes n tokens (or recomputes)

Bit ``t % 32`` of word ``t // 32`` is token ``t`` (llguidance's layout). The host fills the next
step's bitmask only after this step's tokens are known, which already waited for the device, so
one pinned bitmask can be reused step after step. To recompute a request: ``reset()`` then
``accept_many(tokens)`` (microseconds per token). A matcher in thinking mode is free until the
``</think>`` token and constrained from the token after it; rolling back over ``</think>`` frees it
again. A token the grammar forbids (a sampler that skipped the mask) is refused by ``accept`` (it
returns False, the state is kept) and from then on only EOS is allowed, until it is rolled back.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Sequence

import llguidance
import torch

from .grammar import GrammarError, GrammarSpec

_FREE, _GRAMMAR, _REFUSED = 0, 1, 2  # what happened to each accepted token
_TEXT = r'[^"\\<\x00-\x1F\x7F]'
#: llguidance's "slices": token classes whose mask is decided at once instead of walking the
#: vocabulary. Its defaults (JSON string text) minus "<", so they also hold inside DSML raw values
#: and free text (whose lexemes only care about "<"): about 15x cheaper masks there at 129k
#: tokens, the same for JSON.
SLICES = [r"[\x20\x0A\x0D\x09]+", _TEXT + "{1,10}", _TEXT + "{1,30}", _TEXT + "+"]


class GrammarCompiler:
    """One vocabulary's llguidance tokenizer plus a cache of compiled grammars keyed by spec.

    Building the tokenizer index costs about a second at DS4's 129k vocabulary, so there is one per
    served model; compiling a grammar costs about 1-20 ms, so compiled grammars are kept (LRU) and
    each request gets a cheap copy. Thread-safe: the server compiles on request threads."""

    def __init__(self, tokenizer_json: str, *, eos_id: int, think_end_id: int | None = None,
                 vocab_size: int | None = None, cache_size: int = 256):
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id, slices=SLICES)
        self.vocab_size = self.tok.vocab_size
        self.eos_id = eos_id
        self.think_end_id = think_end_id
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tok, *, vocab_size: int | None = None, cache_size: int = 256) -> "GrammarCompiler":
        """A compiler for a ``chat.Tokenizer`` (``vocab_size``: the logits' width, if wider)."""
        return cls(tok._json, eos_id=tok.eos_id, think_end_id=tok.think_end_id,  # its tokenizer.json text
                   vocab_size=max(vocab_size or 0, tok.vocab_size), cache_size=cache_size)

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The pristine matcher of ``spec`` (cached); raises ``GrammarError`` naming the field."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        matcher = llguidance.LLMatcher(self.tok, spec.lark, log_level=0)
        if matcher.is_error():
            raise self._error(spec, matcher.get_error())
        with self._lock:
            self._cache[spec.key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _error(self, spec: GrammarSpec, message: str) -> GrammarError:
        """The library refused ``spec``: find the field whose schema it refuses, for the 400."""
        for field, schema in spec.fields:
            try:
                one = llguidance.LLMatcher.grammar_from_json_schema(schema)
                failed, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(one, self.tok)
            except (ValueError, TypeError) as e:
                failed, msgs = True, [str(e)]
            if failed:
                return GrammarError(field, f"invalid JSON Schema: {msgs[0] if msgs else message}")
        field = "response_format" if spec.mode == "json" else "tools"
        return GrammarError(field, f"the grammar library rejected it: {message}")

    def matcher(self, spec: GrammarSpec | None, *, thinking: bool = False) -> "RequestMatcher":
        """A fresh matcher for one request (``spec`` None: free output, for uniform batches)."""
        if thinking and self.think_end_id is None:
            raise ValueError("thinking mode needs the vocabulary's </think> token id")
        base = self.compile(spec) if spec is not None else None
        return RequestMatcher(base.deep_copy() if base is not None else None, eos_id=self.eos_id,
                              think_end_id=self.think_end_id if thinking else None,
                              mask_words=(self.vocab_size + 31) // 32)

    def allocate_bitmask(self, batch: int) -> torch.Tensor:
        return allocate_bitmask(batch, self.vocab_size)


class RequestMatcher:
    """One request's grammar state (see the module docstring for the protocol)."""

    def __init__(self, matcher: llguidance.LLMatcher | None, *, eos_id: int, think_end_id: int | None = None,
                 mask_words: int | None = None):
        self._m = matcher
        self.mask_words = mask_words  # the grammar's mask width; a wider bitmask row gets zeros past it
        self.eos_id = eos_id
        self.think_end_id = think_end_id
        self._history: list[int] = []  # _FREE / _GRAMMAR / _REFUSED per accepted token
        self._activated_at: int | None = None if think_end_id is not None else 0
        self._refused_at: int | None = None

    @property
    def constrained(self) -> bool:
        """The grammar applies to the next token (thinking is over, and there is a grammar)."""
        return self._m is not None and self._activated_at is not None

    @property
    def in_reasoning(self) -> bool:
        """Thinking mode and ``</think>`` not yet accepted (the engine's reasoning budget reads it)."""
        return self.think_end_id is not None and self._activated_at is None

    @property
    def has_grammar(self) -> bool:
        """A grammar applies to the answer (now, or once the reasoning ends)."""
        return self._m is not None

    @property
    def refused(self) -> bool:
        """A token the grammar forbids was accepted (and not rolled back)."""
        return self._refused_at is not None

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled ``token_id``; False if the grammar forbids it (state kept)."""
        if not self.constrained:
            self._history.append(_FREE)
            if token_id == self.think_end_id and self._activated_at is None:
                self._activated_at = len(self._history)
            return True
        if self._refused_at is None and self._m.is_stopped() and token_id == self.eos_id:
            self._history.append(_FREE)  # the grammar ended on its own (nothing could follow): EOS closes it
            return True
        if self._refused_at is None and not self._m.is_stopped() and self._m.validate_tokens([token_id]) == 1:
            if not self._m.consume_token(token_id):
                raise RuntimeError(f"grammar refused a validated token: {self._m.get_error()}")
            self._history.append(_GRAMMAR)
            return True
        if self._refused_at is None:
            self._refused_at = len(self._history)
        self._history.append(_REFUSED)
        return False

    def accept_many(self, token_ids: Sequence[int]) -> bool:
        ok = True
        for t in token_ids:
            ok = self.accept(t) and ok
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (a step undone, a request recomputed)."""
        if n < 0 or n > len(self._history):
            raise ValueError(f"cannot roll back {n} of {len(self._history)} tokens")
        if n == 0:
            return
        undone = self._history[len(self._history) - n:]
        del self._history[len(self._history) - n:]
        grammar_tokens = undone.count(_GRAMMAR)
        if grammar_tokens and not self._m.rollback(grammar_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._m.get_error()}")
        if self._refused_at is not None and self._refused_at >= len(self._history):
            self._refused_at = None
        if self.think_end_id is not None and self._activated_at is not None and self._activated_at > len(self._history):
            self._activated_at = None

    def forced(self, limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens the grammar forces next (its forced bytes, tokenized by the library:
        a JSON schema's keys and punctuation); none outside the grammar's reach (thinking, ended, refused)."""
        if limit <= 0 or not self.native:
            return ()
        return tuple(self._m.compute_ff_tokens()[:limit])

    def reset(self) -> None:
        """Back to the start (a request recomputed from its prompt)."""
        self.rollback(len(self._history))

    @property
    def native(self) -> bool:
        """The next mask comes from the grammar (not all-free, nor EOS only)."""
        return self.constrained and self._refused_at is None and not self._m.is_stopped() and not self._m.is_error()

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``row`` (one contiguous int32 CPU row of a bitmask).
        Ended, refused or failed (a parser limit hit) grammars allow only EOS, so the request ends."""
        if not self.constrained:
            row.fill_(-1)
        elif not self.native:
            allow_only(row, self.eos_id)
        else:
            words = self.mask_words or row.numel()
            if row.numel() < words:
                raise ValueError(f"bitmask row of {row.numel()} words, the grammar needs {words}")
            self._m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
            row[words:] = 0  # ids past the tokenizer (padded logits) are never allowed

    def is_terminated(self) -> bool:
        """The grammar has ended: EOS was accepted, or nothing can follow what was written (then
        only EOS is allowed next; the engine may stop here or sample that EOS)."""
        return self.constrained and self._m.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete answer (EOS would be allowed), or there is no grammar."""
        return not self.constrained or self._m.is_accepting()

    @property
    def num_tokens(self) -> int:
        return len(self._history)


def allow_only(row: torch.Tensor, token_id: int) -> None:
    """Only ``token_id`` allowed in an int32 bitmask row (bit 31 is the sign bit)."""
    row.zero_()
    word = 1 << (token_id % 32)
    row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word


def forbid(row: torch.Tensor, token_id: int) -> None:
    """Clear ``token_id``'s bit in an int32 bitmask row (the rest of the row unchanged)."""
    word = int(row[token_id // 32]) & ~(1 << (token_id % 32)) & 0xFFFFFFFF
    row[token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A ``[batch, ceil(vocab/32)]`` int32 bitmask, all allowed; pinned when CUDA is there (so the
    copy to the device overlaps)."""
    shape = (batch, (vocab_size + 31) // 32)
    pin = torch.cuda.is_available()
    return torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)


_EXECUTOR: llguidance.LLExecutor | None = None
PARALLEL_MIN_VOCAB = 16384  # below, a row costs less than handing it to a thread
PARALLEL_MIN_CPUS = 8  # measured on 2 cores: the pool is 3-4x slower than one thread


def fill_bitmasks(matchers: Sequence[RequestMatcher | None], bitmask: torch.Tensor, *,
                  parallel: bool | None = None) -> None:
    """Row ``b`` of ``bitmask`` for ``matchers[b]`` (None: free). Constrained rows are computed in
    llguidance's native code, by its thread pool in one call when ``parallel`` (default: for
    vocabularies of 16k tokens and more on 8 CPUs and more, where that pays)."""
    global _EXECUTOR
    if not bitmask.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
        raise ValueError("bitmask must be a contiguous int32 CPU tensor")
    work = []
    for b, m in enumerate(matchers):
        if m is not None and m.native:
            work.append((m._m, b))
        elif m is None:
            bitmask[b].fill_(-1)
        else:
            m.fill_mask(bitmask[b])  # free, ended or refused: no grammar work
    if not work:
        return
    if parallel is None:
        parallel = bitmask.shape[1] * 32 >= PARALLEL_MIN_VOCAB and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS
    words = {m.mask_words for m in matchers if m is not None and m.native} - {None}
    if parallel and len(work) > 1 and words <= {bitmask.shape[1]}:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        _EXECUTOR.unsafe_compute_mask_ptr(work, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
    else:  # one row at a time (also where the bitmask is wider than the grammar's masks)
        for b, m in enumerate(matchers):
            if m is not None and m.native:
                m.fill_mask(bitmask[b])


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: for each byte value, its 8 bits low bit first, as allowed (bool) or as the
    additive logit bias (0 allowed, -inf forbidden)."""
    table = _TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = bits.bool() if dtype == torch.bool else torch.where(bits.bool(), 0.0, float("-inf")).to(dtype)
        table = _TABLES[(device, dtype)] = table.to(device)
    return table


def _expand(bitmask: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 32 W]`` per-token values from the ``[B, W]`` int32 words: one table lookup over the
    words' bytes (little-endian, as on x86, ARM and CUDA), cheaper on CPU than shifting 32 times
    and masked_fill."""
    words = bitmask.to(device, non_blocking=True).contiguous()
    byte_ids = words.view(torch.uint8).reshape(-1).long()
    return _byte_table(device, dtype).index_select(0, byte_ids).view(words.shape[0], -1)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, device: torch.device | None = None) -> torch.Tensor:
    """``[B, vocab]`` bool of allowed tokens (ids past the bitmask's width are not allowed)."""
    allowed = _expand(bitmask, device or bitmask.device, torch.bool)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], dim=1)


def _mask_rows(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    bias = _expand(bitmask, logits.device, logits.dtype)
    width = min(bias.shape[1], logits.shape[1])
    logits[:, :width].add_(bias[:, :width])  # -inf where forbidden; logits are finite, so no NaN
    if logits.shape[1] > width:
        logits[:, width:] = float("-inf")
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set forbidden logits to -inf in place, vectorised over ``[B, V]`` (no loop over requests).

    ``bitmask`` is ``[B, W]`` (or ``[len(rows), W]`` with ``rows``: the batch rows that have a
    grammar, so free rows are not touched). Works on any device; the CPU bitmask is copied over.
    Logits must be finite (an allowed ``+inf`` would become NaN)."""
    if rows is None:
        return _mask_rows(logits, bitmask)
    rows = rows.to(logits.device)
    return logits.index_copy_(0, rows, _mask_rows(logits.index_select(0, rows), bitmask))


__all__ = ["GrammarCompiler", "GrammarError", "RequestMatcher", "allocate_bitmask", "allow_only", "apply_bitmask",
           "fill_bitmasks", "forbid", "unpack_bitmask"]
