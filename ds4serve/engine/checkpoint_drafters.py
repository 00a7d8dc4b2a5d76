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
* **Which DSpark forward** (``dspark_drafts``): the C one (``model/native_dspark.py``) when the target runs
  on the host forward and the drafter's tensors are fp32 host tensors, else the torch one (GPU, bf16,
  packed experts); the reason is logged. Their drafts agree within fp32 rounding, not bit for bit, which
  verification makes harmless: each is deterministic and per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import torch
import torch.nn.functional as F

from ..model.dspark import DSparkRings, SharedHead, draft as dspark_draft, commit as dspark_commit, markov_sample
from ..model.dspark_weights import DSparkWeights
from ..model.mtp import MTPDrafter, MTPState
from ..model.native_dspark import NativeDSpark, unsupported as native_unsupported
from .capture import CapturePlan
from .model_drafts import Block

IMAGE_PAIR_TOKEN = 0

log = logging.getLogger(__name__)


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


class NativeDSparkDrafts(DSparkDrafts):
    """``DSparkDrafts`` with the C forward (``model/native_dspark.py``): one call per commit and per
    block; greedy blocks (``pick.greedy``) stay in C, sampled ones run the torch Markov head over the C
    forward's logits with the engine's draws. The rings are the same fp32 ``DSparkRings``."""

    def __init__(self, weights: DSparkWeights, target, capacity: int):
        super().__init__(weights, target, capacity)
        self.native = NativeDSpark(weights, target, self.rings)

    def commit(self, states, positions, tokens, hidden, owners) -> None:
        if positions.shape[0] == 0:
            return
        slots = torch.tensor([s.slot for s in states], dtype=torch.long).index_select(0, owners.cpu())
        self.native.commit(slots, positions.cpu(), hidden)

    @staticmethod
    def _rows(entries) -> tuple[list[int], list[int], list[int], list[torch.Tensor]]:
        """The backlog entries ``(state, start, ids, hidden rows)`` as row addresses, positions and pool slots
        (and the tensors the addresses point into, to be kept alive)."""
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep = []
        for state, start, ids, hidden in entries:
            if hidden.dtype != torch.float32 or not hidden.is_contiguous() or hidden.device.type != "cpu":
                hidden = hidden.float().contiguous().cpu()
            keep.append(hidden)
            base, stride = hidden.data_ptr(), hidden.stride(0) * 4
            rows += [base + i * stride for i in range(len(ids))]
            positions += range(start, start + len(ids))
            slots += [state.slot] * len(ids)
        return rows, positions, slots, keep

    def commit_entries(self, entries) -> None:
        """``commit`` of the engine's backlog entries ``(state, start, ids, hidden rows)`` as they are: each
        row goes to C by its address (``NativeDSpark.commit_rows``), no tensor built for the call."""
        rows, positions, slots, _keep = self._rows(entries)
        self.native.commit_rows(rows, positions, slots)

    def start_greedy(self, entries, states, anchors: list[int], anchor_positions: list[int], threads: int):
        """``commit_entries(entries)`` then ``propose_greedy`` as one job on the host pool's worker
        (``NativeDSpark.start``; its ``wait`` gives ``propose_greedy``'s result)."""
        rows, positions, slots, keep = self._rows(entries)
        return self.native.start(rows, positions, slots, [s.slot for s in states], anchors, anchor_positions, threads,
                                 keep)

    def propose_greedy(self, states, anchors: list[int], anchor_positions: list[int]
                       ) -> tuple[list[bool], list[list[int]], list[list[float]]]:
        """``(ready, tokens, survival)`` of greedy blocks in one C call (``NativeDSpark.propose_greedy``):
        ``ready`` as ``ready`` says it, the rest what ``draft`` with an all-greedy pick gives."""
        return self.native.propose_greedy([s.slot for s in states], anchors, anchor_positions)

    def ready(self, states, last: torch.Tensor) -> list[bool]:
        """``DSparkRings.complete`` in C (``NativeDSpark.ready``, the rule ``propose_greedy`` applies too)."""
        return self.native.ready([s.slot for s in states], last.tolist())

    def draft(self, states, anchors, anchor_positions, pick) -> Block:
        greedy = bool(getattr(pick, "greedy", False))
        slots = torch.tensor([s.slot for s in states], dtype=torch.long)
        base, hidden, tokens, conf = self.native.draft(slots, anchors.cpu(), anchor_positions.cpu(), greedy)
        if not greedy:
            out = markov_sample(self.weights, base, hidden, anchors, pick)
            return Block(out.tokens, out.q, out.survival)
        # draft_probs's greedy q, one-hot at the argmax, only where something reads it (rejection sampling)
        q = F.one_hot(tokens, base.shape[-1]).float() if getattr(pick, "needs_q", True) else None
        return Block(tokens, q, torch.cumprod(conf, dim=1))


def dspark_drafts(weights: DSparkWeights, target, capacity: int, host_forward: bool) -> DSparkDrafts:
    """The DSpark adapter for this target: the C forward beside the host forward where it applies."""
    if host_forward:
        why = native_unsupported(weights, target)
        if why is None:
            log.info("DSpark drafter: the native host forward (csrc/host_dspark.c)")
            return NativeDSparkDrafts(weights, target, capacity)
        log.info("DSpark drafter: the torch forward (the native one does not apply: %s)", why)
    return DSparkDrafts(weights, target, capacity)


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
