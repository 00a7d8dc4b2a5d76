"""The Python API: ``LLM(path).generate(prompts, ...)`` and ``LLM(path).prompt_logits(ids)``.

``generate`` submits every prompt to the same engine the server uses (a ``runtime.EngineCore``) and steps
it in the calling thread: each step is one flattened forward holding the decode rows of all
running sequences (at different lengths) plus prompt chunks within the step budget. Nothing is
padded, so each prompt gets exactly the tokens it would get alone.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from .cache import SeqChunk
from .engine.reference_forward import ReferenceForward
from .engine.sampling import SamplingParams
from .model import load_model, parse_dtype
from .runtime import assemble_core
from .scheduler.scheduler import QueueFull, RequestTooLarge
from .scheduler.spec import RequestSpec
from .settings import EngineSettings

log = logging.getLogger(__name__)


class LLM:
    """A DeepSeek-V4 checkpoint loaded for batched inference.

    Executor settings (``max_seqs``, ``kv_budget``, ``host_budget``, ``step_tokens``,
    ``max_prefill_tokens``, ``prefill_mode``, ``max_model_len``, ...) are keyword arguments; see
    ``ds4serve.settings.EngineSettings``. Tiny budgets are allowed, e.g. to force preemption in tests.
    Offline generation plans by the token budget (``max_stall=0``) unless told otherwise: a batch job
    has no streams to keep smooth, and its chunk boundaries then never depend on the machine's speed.
    """

    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32", *, progress: bool = False,
                 eos_ids: Sequence[int] | None = None, packed_experts: bool = False, stored_weights: bool = False,
                 **settings):
        self.cfg, self.model = load_model(path, device=device, dtype=dtype, progress=progress,
                                          packed_experts=packed_experts, stored_weights=stored_weights)
        self.device = torch.device(device)
        settings.setdefault("max_stall", 0.0)
        self.core = assemble_core(self.cfg, self.model, EngineSettings(**settings), self.device, parse_dtype(dtype),
                                  eos_ids=eos_ids, checkpoint=Path(path))
        self.reference = ReferenceForward(self.cfg, self.model, self.core.cache.state)

    @property
    def state(self):
        return self.core.cache.state

    @property
    def max_model_len(self) -> int:
        return self.core.resolved.max_model_len

    # ------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, **sampling) -> list[list[int]]:
        """Generate up to ``max_tokens`` tokens for every prompt, all prompts batched together.

        Extra keyword arguments are ``SamplingParams`` fields (``top_p``, ``top_k``, ``ignore_eos``...).
        Generation stops early at an EOS id unless ``ignore_eos=True``.
        """
        return [ids for ids, _ in self.generate_with_logprobs(prompts, max_tokens, temperature, seed, **sampling)]

    def generate_with_logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
                               seed: int | None = None, **sampling) -> list[tuple[list[int], list]]:
        """``generate``, and for each prompt the per-token log-probabilities the sampler reported: with
        ``logprobs=k``, ``(chosen token's logprob, ((id, logprob) x k))`` per new token, else empty."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **sampling)
        return [(list(r.output_ids), list(r.output_logprobs)) for r in self._run(prompts, params)]

    def generate_timed(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
                       seed: int | None = None, stream_of: Sequence[int] | None = None,
                       **sampling) -> tuple[list[list[int]], list[tuple[float, float]]]:
        """``generate``, and for each prompt the seconds from the call to its first and to its last token:
        what a bench needs to tell a request's decode rate (the tokens after the first over the time
        after it) from its prefill. ``stream_of``: prompt ``i`` belongs to client stream ``stream_of[i]``,
        whose prompts run one after another (``_run``); None: every prompt at once."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **sampling)
        firsts: dict[str, float] = {}
        lasts: dict[str, float] = {}
        t0 = time.perf_counter()
        reqs = self._run(prompts, params, token_times=(firsts, lasts), stream_of=stream_of)
        return [list(r.output_ids) for r in reqs], [(firsts[r.request_id] - t0, lasts[r.request_id] - t0) for r in reqs]

    def score_prompts(self, prompts: Sequence[Sequence[int]], top: int = 0, max_tokens: int = 0,
                      **sampling) -> list[list]:
        """Every prompt's prompt logprobs as the batched steps compute them (``prompt_logprobs=top``): per
        prompt ``[None, (logprob, rank, ((id, logprob) x top)), ...]``, one entry per prompt token. With
        ``max_tokens`` 0 nothing is generated; otherwise generation runs beside it as in ``generate``."""
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=top, **{"temperature": 0.0, **sampling})
        outs: dict[str, tuple] = {}
        reqs = self._run(prompts, params, outs)
        return [list(outs[r.request_id]) for r in reqs]

    def _run(self, prompts: Sequence[Sequence[int]], params: SamplingParams, prompt_lps: dict | None = None,
             token_times: tuple[dict, dict] | None = None, stream_of: Sequence[int] | None = None) -> list:
        """Submit every prompt and step the engine until all finish; a failed request raises. ``prompt_lps``
        collects each request's prompt logprobs (they ride on its first output); ``token_times`` the
        ``perf_counter`` time each request's first and last tokens came out; ``stream_of`` each prompt's
        client stream: a prompt is sent once the one before it in its stream finished, as a closed-loop
        client sends (None: all at once)."""
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        specs = [RequestSpec(p, params) for p in prompts]
        for i, spec in enumerate(specs):  # refuse the batch before any of it runs
            problem = self.core.fit(spec)
            if problem:
                raise RequestTooLarge(f"prompt {i}: {problem}")
        reqs = [self.core.make_request(spec) for spec in specs]
        stream = {r.request_id: i if stream_of is None else stream_of[i] for i, r in enumerate(reqs)}
        held: dict[int, deque] = {}  # each stream's prompts after its first, sent as the one before finishes
        todo: deque = deque()
        for r in reqs:
            if stream[r.request_id] in held:
                held[stream[r.request_id]].append(r)
            else:
                held[stream[r.request_id]] = deque()
                todo.append(r)
        while todo or self.core.has_work:
            while todo:
                try:
                    self.core.add(todo[0])
                except QueueFull:
                    break
                todo.popleft()
            for out in self.core.step():
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if token_times is not None and out.new_token_ids:
                    token_times[0].setdefault(out.request_id, time.perf_counter())
                    token_times[1][out.request_id] = time.perf_counter()
                if out.prompt_logprobs is not None and prompt_lps is not None:
                    prompt_lps[out.request_id] = out.prompt_logprobs
                if out.finished and held[stream[out.request_id]]:
                    todo.append(held[stream[out.request_id]].popleft())
        return reqs

    def prompt_logits(self, ids: Sequence[int], engine: bool = False) -> torch.Tensor:
        """fp32 logits ``[len(ids), vocab]`` of one prompt (chunks of ``max_prefill_tokens``).

        ``engine`` False: the torch forward and head (the reference the native forward is checked against);
        True: the serving engine's own forward and head (native where it runs), one chunk per forward, so
        its rows are the bits the steps' prompt logprobs start from (``Executor.prompt_logits``)."""
        ids = list(ids)
        if not ids:
            raise ValueError("empty prompt")
        problem = self.core.fit(RequestSpec(ids, SamplingParams(max_tokens=0)))
        if problem:
            raise RequestTooLarge(problem)
        if self.core.has_work:
            raise RuntimeError("prompt_logits needs an idle engine")
        cache = self.core.cache
        slot = cache.alloc_slot()
        chunk = self.core.settings.max_prefill_tokens
        outs = []
        try:
            for start in range(0, len(ids), chunk):
                piece = ids[start:start + chunk]
                if not cache.reserve({slot: start + len(piece)}):
                    raise RuntimeError("not enough cache pages for this prompt")
                chunks = [SeqChunk(slot, start, piece, cache.block_table(slot))]
                outs.append(self.core.executor.prompt_logits(chunks) if engine
                            else self.reference.forward(chunks, all_logits=True))
        finally:
            cache.drop(slot)
        return torch.cat(outs)
