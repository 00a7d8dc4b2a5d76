"""The checkpoint drafters as the engine drives them (``model_drafts.DraftModel``): DSpark and MTP.

Each adapter turns the engine's flat per-step rows (positions, input tokens, captured hidden, owner
index) into its drafter's calls, and its blocks into ``model_drafts.Block``. Decisions that live here:

* **Image positions** (MTP): the block embeds the token *after* each position (``ds4-speculative.md``
  §2.2); where that is an image placeholder id (no row in the shared embedding) the pair uses
  ``IMAGE_PAIR_TOKEN`` instead. Only the drafter's guess near an image is affected: verification is exact.
* **Readiness**: a state built after a prefix-cache hit lacks the rows below the hit. DSpark's rings say
  whether the block's window is whole (``DSparkRings.complete``); an MTP state is whole once it holds
  ``sliding_window`` rows or started at position 0. Not ready: no proposal (counted by the engine).
* **Draws**: the engine's ``pick`` (``model_drafts``) draws every token of a block and gives its ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.dspark import DSparkRings, SharedHead, draft as dspark_draft, commit as dspark_commit
from ..model.dspark_weights import DSparkWeights
from ..model.mtp import MTPDrafter, MTPState
from .capture import CapturePlan
from .model_drafts import Block

IMAGE_PAIR_TOKEN = 0


class DSparkDrafts:
    """DSpark's three-stage block drafter over one ring pool of ``capacity`` requests."""

    def __init__(self, weights: DSparkWeights, target, capacity: int):
        self.weights = weights
        self.head = SharedHead.from_target(target)
        dtype = target.model.embed_tokens.weight.dtype if target.compute_dtype is None else target.compute_dtype
        self.rings = DSparkRings(weights.config, capacity, target.model.embed_tokens.weight.device,
                                 dtype=torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype)
        self.plan = CapturePlan(tuple(weights.config.target_layer_ids), mean_hc=True)
        self.block = weights.config.block_size
        self.keep_rows = weights.config.window  # the ring: rows of the last ``window`` positions

    def new_state(self):
        return self.rings.new_state()

    def release(self, state) -> None:
        self.rings.release(state)

    def commit(self, states, positions, tokens, hidden, owners) -> None:
        dspark_commit(self.weights, states, positions, hidden, owners)

    def ready(self, states, last: torch.Tensor) -> list[bool]:
        return self.rings.complete(states, last).tolist()

    def draft(self, states, anchors, anchor_positions, pick) -> Block:
        out = dspark_draft(self.weights, states, anchors, anchor_positions, self.head, sampler=pick)
        return Block(out.tokens, out.q, out.survival)


@dataclass
class _MTPSlot:
    """An MTP state made at the first committed position (a prefix-cache hit starts above 0)."""

    state: MTPState | None = None
    start: int = 0


class MTPDrafts:
    """The serial MTP block, ``k`` chained steps a block (``num_speculative_tokens``)."""

    def __init__(self, drafter: MTPDrafter, k: int):
        self.drafter, self.block = drafter, k
        self.plan = CapturePlan((drafter.cfg.num_layers - 1,), mean_hc=False)  # the pre-hc_head residual
        self.keep_rows = drafter.cfg.sliding_window + 1  # the ring's rows and the residual before them
        self._hc, self._d, self._vocab = drafter.cfg.hc_mult, drafter.cfg.hidden_size, drafter.cfg.vocab_size

    def new_state(self) -> _MTPSlot:
        return _MTPSlot()

    def release(self, state) -> None:
        state.state = None

    def commit(self, states, positions, tokens, hidden, owners) -> None:
        tokens = torch.where(tokens < self._vocab, tokens, torch.full_like(tokens, IMAGE_PAIR_TOKEN))
        hidden = hidden.reshape(hidden.shape[0], self._hc, self._d)
        order = owners.tolist()
        per: dict[int, list[int]] = {}
        for row, owner in enumerate(order):
            per.setdefault(owner, []).append(row)
        live, pos, toks, hids = [], [], [], []
        for owner, rows in per.items():
            slot = states[owner]
            first = int(positions[rows[0]])
            if slot.state is None or slot.state.next_pos != first:  # new, or rows skipped while not drafting
                slot.state, slot.start = MTPState.new(self.drafter, first), first
            index = torch.tensor(rows)
            live.append(slot.state)
            pos.append(first)
            toks.append(tokens.index_select(0, index))
            hids.append(hidden.index_select(0, index))
        self.drafter.commit(live, pos, toks, hids)

    def ready(self, states, last: torch.Tensor) -> list[bool]:
        window = self.drafter.cfg.sliding_window
        return [s.state is not None and s.state.prev_hidden is not None
                and (s.start == 0 or s.state.next_pos - s.start >= window) for s in states]

    def draft(self, states, anchors, anchor_positions, pick) -> Block:
        out = self.drafter.draft([s.state for s in states], anchors, self.block,
                                 sampler=lambda step, logits: pick(logits, step))
        return Block(out.tokens, out.q, torch.cumprod(out.confidence, dim=1))
