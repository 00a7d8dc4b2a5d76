"""Drive ds4serve's runner directly: (chunked) prefill then greedy decode, returning logits."""

from __future__ import annotations

import torch

from ds4serve.cache import SeqChunk


def ours_incremental(llm, prompt: list[int], steps: int, chunks: list[int] | None = None,
                     forced: list[int] | None = None):
    """Mirror of ``checkpoints.hf_incremental`` on ds4serve (one slot, one sequence)."""
    cache = llm.core.cache
    chunks = chunks or [len(prompt)]
    assert sum(chunks) == len(prompt)
    slot = cache.alloc_slot()

    def fwd(start: int, piece: list[int]) -> torch.Tensor:
        assert cache.reserve({slot: start + len(piece)})
        return llm.reference.forward([SeqChunk(slot, start, piece, cache.block_table(slot))], all_logits=True)

    try:
        outs, pos = [], 0
        for n in chunks:
            outs.append(fwd(pos, prompt[pos:pos + n]))
            pos += n
        prompt_logits = torch.cat(outs)
        tok = int(prompt_logits[-1].argmax())
        dec, toks = [], []
        for i in range(steps):
            if forced is not None:
                tok = forced[i]
            toks.append(tok)
            logits = fwd(pos, [tok])[0]
            pos += 1
            dec.append(logits)
            tok = int(logits.argmax())
        return prompt_logits, torch.stack(dec) if dec else torch.empty(0), toks
    finally:
        cache.drop(slot)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def feed(core, reqs, every: int = 0, encoded: bool = False) -> None:
    """Step ``core`` until idle, request i arriving at step ``i * every`` (0: all at once). ``encoded``:
    every admitted request's images are encoded before the next step, so which step first sees an image
    ready depends on the steps alone, not on how fast the encoder thread runs against the engine (tests
    that need the pool to fill in a given way)."""
    pending, step = list(reqs), 0
    while pending or core.has_work:
        while pending and step >= every * (len(reqs) - len(pending)):
            core.add(pending.pop(0))
        for r in core.scheduler.running if encoded else ():
            if r.images_submitted:
                assert core.encoder.wait(r.request_id, 60), f"{r.request_id}: images not encoded in 60 s"
        core.step()
        step += 1


def write_random_text_checkpoint(path, **overrides):
    """A text-only checkpoint of ``random_config`` (vocab 1000) with ``overrides`` and seeded random
    weights (``tiny.random_model``), for shapes the shared fixtures do not have; returns ``path``."""
    import json

    from safetensors.torch import save_file

    from ds4serve.config import ModelConfig
    from ds4serve.tiny.random_model import random_config, random_weights

    config = dict(random_config(1000, vision=False), **overrides)
    save_file(random_weights(ModelConfig.from_dict(config)), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path
