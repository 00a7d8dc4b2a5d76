"""The Python API: ``LLM(path).generate(prompts, ...)`` and ``LLM(path).prompt_logits(ids)``.

``generate`` runs every prompt *together*: each step is one flattened forward holding the decode
rows of all running sequences (at different lengths) plus prompt chunks within a token budget.
No sequence is padded, so each prompt gets exactly the tokens it would get alone.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cache import ModelState, SeqChunk, StateLayout
from .engine import ModelRunner
from .model import load_model, parse_dtype

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    max_tokens: int
    generator: torch.Generator | None
    slot: int = -1
    computed: int = 0  # tokens whose state is in the cache
    out: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens


class LLM:
    """A DeepSeek-V4 checkpoint loaded for batched inference."""

    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32", *, max_seqs: int = 16,
                 max_model_len: int = 4096, prefill_chunk: int = 512, page_tokens: int | None = None,
                 progress: bool = False):
        self.cfg, self.model = load_model(path, device=device, dtype=dtype, progress=progress)
        self.device = torch.device(device)
        self.max_model_len = min(max_model_len, self.cfg.max_position_embeddings)
        self.prefill_chunk = prefill_chunk
        layout = StateLayout.build(self.cfg, parse_dtype(dtype), page_tokens)
        n_pages = max_seqs * layout.pages_for(self.max_model_len)
        self.state = ModelState(layout, n_slots=max_seqs, n_pages=n_pages, device=self.device)
        self.runner = ModelRunner(self.cfg, self.model, self.state)

    # ------------------------------------------------------------------------------------------
    def prompt_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits ``[len(ids), vocab]`` of one prompt, computed in chunks of ``prefill_chunk``."""
        ids = list(ids)
        self._check_len(len(ids))
        slot = 0
        outs = []
        try:
            for start in range(0, len(ids), self.prefill_chunk):
                piece = ids[start:start + self.prefill_chunk]
                outs.append(self.runner.forward([self._chunk(slot, start, piece)], all_logits=True))
        finally:
            self.state.pages.release(slot)
        return torch.cat(outs)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[list[int]]:
        """Generate ``max_tokens`` tokens for every prompt, all prompts batched together."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        seqs = []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            self._check_len(len(p) + max_tokens)
            gen = None
            if temperature > 0:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed if seed is not None else torch.seed())
            seqs.append(_Seq(index=i, prompt=list(p), max_tokens=max_tokens, generator=gen))
        waiting, running = deque(seqs), []
        free_slots = list(range(self.state.n_slots - 1, -1, -1))
        while waiting or running:
            while waiting and free_slots:
                s = waiting.popleft()
                s.slot = free_slots.pop()
                running.append(s)
            self._step(running, temperature)
            for s in [s for s in running if s.done]:
                running.remove(s)
                self.state.pages.release(s.slot)
                free_slots.append(s.slot)
        return [s.out for s in seqs]

    # ------------------------------------------------------------------------------------------
    def _step(self, running: list[_Seq], temperature: float) -> None:
        """One forward: every decoder once, plus prompt chunks within the prefill budget."""
        budget = self.prefill_chunk
        chunks, sample = [], []
        for s in running:
            if s.computed < len(s.prompt):
                if budget <= 0:
                    continue
                piece = s.prompt[s.computed:s.computed + budget]
                budget -= len(piece)
                chunks.append(self._chunk(s.slot, s.computed, piece))
                s.computed += len(piece)
                sample.append(s if s.computed == len(s.prompt) else None)
            else:
                chunks.append(self._chunk(s.slot, s.computed, [s.out[-1]]))
                s.computed += 1
                sample.append(s)
        logits = self.runner.forward(chunks)
        for row, s in enumerate(sample):
            if s is not None:
                s.out.append(_sample(logits[row], temperature, s.generator))

    def _chunk(self, slot: int, start: int, ids: list[int]) -> SeqChunk:
        pages = self.state.layout.pages_for(start + len(ids))
        if not self.state.pages.reserve(slot, pages):
            raise RuntimeError("out of cache pages; raise max_model_len or lower max_seqs")
        return SeqChunk(slot=slot, start=start, ids=ids, block_table=self.state.pages.table(slot))

    def _check_len(self, n: int) -> None:
        if n > self.max_model_len:
            raise ValueError(f"sequence of {n} tokens exceeds max_model_len {self.max_model_len}")


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
