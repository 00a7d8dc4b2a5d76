"""The engine: executes one ``StepPlan`` and returns its ``StepResult`` (see ``plan.py``).

Per step it runs at most one *merged* forward over all layers, holding every decoder row plus the
passes that run start-to-finish in this step (token chunks), and one forward per layer slice of a
pass that spans several steps. A multi-step pass keeps its hidden streams in the per-slot staging
buffers allocated at start-up, and its index view, between slices. Then it samples every row that
needs a token in one batched call. A step whose rows all decode goes through the ``DecodeRunner``
(fixed shapes, CUDA graphs where enabled; see ``decode_graphs.py``). A forward that raises fails the
step's requests (reported, never silent) and leaves the engine usable.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import SeqChunk, build_view
from ..cache.draft_rows import DraftSpan, SavedRings
from ..cache.manager import CacheManager
from ..cache.native_view import ViewReuse
from ..config import ModelConfig
from ..environment import openmp_spin_advice
from ..model import BatchView, DS4ForCausalLM
from ..model.decoder import RopeTables
from ..model.host_forward import HostForward, description as host_build
from .capture import CapturePlan
from .constraints import constrain
from .decode_graphs import DecodeRunner, resolve_mode
from .drafted import Verified, row_states, settle
from .model_drafts import Ask, ModelDrafts, Proposal, ProposeTiming, StepFeed
from .plan import (DecodeRow, PassMember, PassProgress, PassSlice, RowStatus, SampledToken, StepPlan, StepResult,
                   StepStatus, drafter_captures)
from .prompt_scoring import ScoredRows, keep_rows, score
from .sampling import sample_rows
from .spec_verify import Draft, verify_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Owner:
    """A sequence that gets tokens this step: its sampler, and the draft it verifies (if any)."""

    request_id: str
    slot: int
    sampler: object
    draft: tuple[int, ...] = ()
    position: int = -1  # a decoder's: where its token is fed (a model draft is checked against it)
    propose: bool = True  # a checkpoint drafter drafts its next block (``DecodeRow.propose``)

    @property
    def rows(self) -> int:
        return 1 + len(self.draft)


@dataclass
class _PassState:
    members: tuple[PassMember, ...]
    view: BatchView
    rope: RopeTables | None  # the torch path's rotations, made on its first slice (None: not yet, or native)
    cursor: int
    captured: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # a drafter's, by layer
    follow: bool = False  # a checkpoint drafter reads this pass (some member follows): its layers capture


class StepError(RuntimeError):
    """The engine was asked for something the plan contract forbids (a scheduler bug)."""


@functools.cache
def _warn_spin_once() -> None:
    """Once per process: the OpenMP spin advice (``environment.openmp_spin_advice``), if it applies."""
    advice = openmp_spin_advice()
    if advice:
        log.warning(advice)


class Executor:
    def __init__(self, cfg: ModelConfig, model: DS4ForCausalLM, cache: CacheManager, decode_graphs: str = "off",
                 sample: bool = True, host_kernels: str = "off", moe_activations: str = "auto",
                 head_activations: str = "auto", fp8_activations: str = "auto"):
        """``sample`` False: a tensor-parallel worker, which runs the forwards but leaves sampling
        (and so the LM head) to rank 0. ``host_kernels``: text forwards as one native call where that
        applies (``EngineSettings.host_kernels``); ``moe_activations`` / ``head_activations`` /
        ``fp8_activations``: how it multiplies packed MXFP4 experts, a bf16 LM head and FP8 projections
        (``EngineSettings``)."""
        self.cfg = cfg
        self.sample = sample
        self.model = model
        self.cache = cache
        self.device = cache.state.device
        self.num_layers = cfg.num_layers
        self._passes: dict[int, _PassState] = {}
        state = cache.state
        self.decode = DecodeRunner(resolve_mode(decode_graphs, self.device), self._decode_forward, cache.n_slots,
                                   cfg.sliding_window, {m: state.scratch_row(m) for m in cfg.distinct_ratios})
        self.host = self._host_forward(host_kernels, moe_activations, head_activations, fp8_activations)
        self.capture: CapturePlan | None = None  # what a model drafter reads from the forward (``capture.py``)
        self.drafts: ModelDrafts | None = None  # a checkpoint drafter (``use_drafter``); None: n-gram or none
        self._merged_view = ViewReuse()  # the merged forward's view buffers, refilled while its shape holds
        # tensor parallel: how every rank learns the accepted drafts of a step, whose sampling is rank 0's
        # (``parallel_executor.Collectives.agree``: rank 0's counts, the workers' zeros, summed); None: one process
        self.agree: Callable[[list[int]], list[int]] | None = None
        # a checkpoint drafter's greedy blocks drafted on the host pool's worker while the step is applied
        # (``ModelDrafts.propose_later``): only for a caller that collects them (``settle_drafts``) before
        # its next step, as ``EngineCore`` does; one process, more than one thread
        self.overlap_drafts = False

    def use_drafter(self, drafts: ModelDrafts) -> None:
        """Run ``drafts`` with every step: its captures split the forward, its blocks are verified
        against their own ``q`` (decode graphs are not used with it: their fixed forward has no split)."""
        self.drafts, self.capture = drafts, drafts.plan

    def _host_forward(self, mode: str, moe_activations: str, head_activations: str,
                      fp8_activations: str) -> HostForward | None:
        if mode == "off" or self.model is None:
            return None
        host, why = HostForward.create(self.cfg, self.model, self.cache.state.layers, moe_activations,
                                       head_activations, fp8_activations)
        if host is None:
            if mode == "on":
                raise RuntimeError(f"host_kernels='on', but the native forward cannot run here: {why}")
            log.info("native host forward not used (%s): text forwards take the torch path", why)
        else:
            log.info("native host forward on, built for %s: every forward (decode rows, prefill chunks, image "
                     "passes) runs as one native call", host_build())
            if host.moe_activations == "int8":
                log.info("packed MXFP4 experts multiply on int8 activations (%s kernel; --moe-activations fp32 "
                         "for the dequantised weights' exact products)", host.lib.ds4_q8_kernel().decode())
            if host.head_activations == "bf16":
                log.info("the bf16 LM head multiplies bf16-rounded rows (%s; --head-activations fp32 for the "
                         "fp32 rows' exact products)", host.lib.ds4_p16_kernel().decode())
            if host.fp8_pairs:
                log.info("%d FP8 projections multiply bf16-rounded rows (%s; --fp8-activations fp32 for the "
                         "dequantised weights' exact products)%s", len(host.fp8_pairs),
                         host.lib.ds4_f8p_kernel().decode(),
                         f"; {len(host.fp8_kept)} keep fp32 rows ({host.fp8_kept[0]}, ...)" if host.fp8_kept else "")
            _warn_spin_once()
        return host

    def disable_host(self, why: str) -> None:
        """Back to the torch path for good (the start-up self-check found a difference)."""
        if self.host is not None:
            log.error("native host forward turned off (%s); text forwards take the torch path", why)
            self.host.close()
            self.host = None

    @torch.inference_mode()
    def host_disagrees(self, chunks: list[SeqChunk], what: str, tolerance: float, head: bool = True,
                       head_tolerance: float | None = None) -> str | None:
        """Run one forward of ``chunks`` both ways, and (``head``) the LM head on its last row: None when the
        native results are within ``tolerance`` (the logits: ``head_tolerance``, default the same) of the
        torch ones (relative to their scale), else what differs.
        Only for views that are the same forward when run twice (see ``warmup.check_host``)."""
        # with query tiles: the torch reference of a long chunk then attends over shared key blocks instead
        # of gathering a private key list per query (~70 MB more at start-up on the Flash-shaped checkpoint)
        view = build_view(self.cache.layout, self.cache.n_slots, chunks, self.device,
                          max_image_tokens=self.cfg.vision.max_n_token, tiles=True)
        ref = self._decode_forward(view)
        got = self.host.forward(view)
        pairs = [(ref, got, "hidden states", tolerance)]
        if head:
            pairs.append((self.model.logits(ref[-1:]), self.host.logits(ref[-1:]), "logits",
                          tolerance if head_tolerance is None else head_tolerance))
        for a, b, name, tol in pairs:
            scale = max(1.0, float(a.abs().max()))  # sync-ok: start-up self-check
            diff = float((a - b).abs().max()) if bool(torch.isfinite(b).all()) else float("inf")  # sync-ok
            if not diff <= tol * scale:
                return f"{name} of {what} differ by {diff:.3g} (scale {scale:.3g})"
        return None

    def _forward(self, view: BatchView, into: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Embedding + every layer: natively where the host decoder takes the view, else torch. With
        ``into`` and a ``capture`` plan (a model drafter's), the captured layers' outputs land there."""
        if into is not None and self.capture is not None:
            return self._captured(view, None, None, 0, self.num_layers, into)
        if self.host is not None and self.host.takes(view):
            return self.host.forward(view)
        return self._decode_forward(view)

    def _segment(self, view: BatchView, rope: RopeTables | None, streams: torch.Tensor | None, start: int,
                 stop: int) -> torch.Tensor:
        """Layers ``[start, stop)`` of ``view``, from its embedding when ``streams`` is None: one piece of
        a forward split for captures (``capture.CapturePlan``), bit-equal to the same layers unsplit."""
        if self.host is not None and self.host.takes(view):
            return self.host.forward(view, start, stop, streams)
        if streams is None:
            streams = self.model.embed(view)
        return self.model.forward_layers(streams, view, self.cache.state.layers, start, stop, rope=rope)

    def _decode_forward(self, view: BatchView) -> torch.Tensor:
        return self.model.forward_layers(self.model.embed(view), view, self.cache.state.layers)

    @property
    def active_passes(self) -> set[int]:
        return set(self._passes)

    def cancel_pass(self, pass_id: int) -> None:
        """Forget a pass in flight (its requests were aborted or failed); its staging is free again."""
        self._passes.pop(pass_id, None)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for pass_id in plan.retired:
            self.cancel_pass(pass_id)
        try:
            tokens, progress, prompt, (draft_s, proposals, timing) = self._execute(plan)
        except Exception as exc:  # one bad step fails its requests, not the engine
            log.exception("step %d failed (%d decoders, %d pass slices)", plan.step_id, len(plan.decodes),
                          len(plan.passes))
            if self.drafts is not None:
                self.drafts.settle()  # nothing of the step is kept, but a job on the worker is waited for
            for p in plan.passes:
                self._passes.pop(p.pass_id, None)
            return StepResult(step_id=plan.step_id, tokens=(), passes=(), status=StepStatus.FAILED,
                              error=f"{type(exc).__name__}: {exc}", elapsed_s=time.perf_counter() - t0)
        later = timing is None  # the blocks are still being drafted (``settle_drafts``)
        timing = timing or ProposeTiming()
        return StepResult(step_id=plan.step_id, tokens=tokens, passes=progress, elapsed_s=time.perf_counter() - t0,
                          prompt_logprobs=prompt, draft_s=draft_s, proposals=proposals,
                          draft_prompt_s=timing.prompt_s, block_s=timing.block_s, drafting=later)

    # ------------------------------------------------------------------------------------------
    def _execute(self, plan: StepPlan):
        L = self.num_layers
        whole = [p for p in plan.passes if p.layer_start == 0 and p.layer_stop == L]
        sliced = [p for p in plan.passes if p not in whole]
        rows: list[torch.Tensor] = []  # hidden streams of rows to sample, in ``owners`` order
        owners: list[_Owner] = []
        scored: list[ScoredRows] = []  # prompt rows to score (``prompt_scoring``), members that ask only
        saved = None
        fed = StepFeed()  # what a model drafter reads of this step (``model_drafts``), when one runs
        if plan.decodes or whole:
            saved = self._merged_forward(plan.decodes, whole, rows, owners, scored, fed)
        progress = [PassProgress(p.pass_id, L, True) for p in whole]
        for p in sliced:
            progress.append(self._advance(p, rows, owners, scored, fed))
        tokens = self._sample(rows, owners)
        if saved is not None:  # the rejected tail of every draft leaves no trace in the rings
            accepted = {t.slot: len(t.accepted) for t in tokens}
            counts = [accepted.get(s.slot, 0) for s in saved.spans]
            saved.restore(counts if self.agree is None else self.agree(counts))
        drafting = (0.0, 0, ProposeTiming())
        if self.drafts is not None and self.sample:
            tokens, drafting = self._draft_next(fed, plan.decodes, owners, tokens)
        return tuple(tokens), tuple(progress), score(self.head, scored) if self.sample else (), drafting

    def _draft_next(self, fed: StepFeed, decodes: tuple[DecodeRow, ...], owners: list[_Owner],
                    tokens: list[SampledToken]
                    ) -> tuple[list[SampledToken], tuple[float, int, ProposeTiming | None]]:
        """The model drafter's turn (``model_drafts``): commit what this step committed, then draft the
        next block of every sequence that got a token and is to propose; each token carries its block's
        tokens. Also returns the seconds the drafting took and how many blocks (the scheduler's cost).
        With ``overlap_drafts`` greedy blocks of the native DSpark drafter are drafted on the host pool's
        worker instead: the tokens carry none and the timing is None (``settle_drafts`` has both)."""
        if not fed.entries:  # nothing captured this step: nothing to commit, no sequence to draft for
            return tokens, (0.0, 0, ProposeTiming())
        ok = {t.slot: t for t in tokens if t.status is RowStatus.OK}
        kept = {d.slot: 1 + len(ok[d.slot].accepted) if d.slot in ok else 0 for d in decodes}
        if fed.entries:
            self.drafts.commit(fed.entries, fed.rows(), kept)
        position = {f.slot: f.start + kept.get(f.slot, len(f.ids)) for f in fed.entries}
        asks = [Ask(o.request_id, o.slot, ok[o.slot].token, position[o.slot], o.sampler,
                    len(o.sampler.output_ids) + 1 + len(ok[o.slot].accepted))  # its block's first output index
                for o in owners if o.propose and o.slot in ok and o.slot in position]
        t0 = time.perf_counter()
        if self.overlap_drafts and self.agree is None and asks \
                and self.drafts.propose_later(asks, torch.get_num_threads()):
            return tokens, (time.perf_counter() - t0, len(asks), None)  # ``settle_drafts`` gives the blocks
        proposals = self.drafts.propose(asks)
        spent = time.perf_counter() - t0
        return [t.with_proposal(proposals[t.slot].tokens, proposals[t.slot].survival)
                if t.slot in proposals else t for t in tokens], (spent, len(asks), self.drafts.timing)

    def settle_drafts(self) -> tuple[dict[int, Proposal], ProposeTiming]:
        """The blocks a step left drafting on the pool's worker (``StepResult.drafting``), by slot, and how
        the seconds the engine itself spent on them split (``ModelDrafts.settle``)."""
        if self.drafts is None:
            return {}, ProposeTiming()
        return self.drafts.settle(), self.drafts.timing

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """The LM head the steps sample with: native where the host forward runs, else torch."""
        return self.host.logits(streams) if self.host is not None else self.model.logits(streams)

    @torch.inference_mode()
    def prompt_logits(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """fp32 logits of every row of ``chunks`` through this engine's own forward and head (the reference
        the steps' prompt logprobs are exact against; ``LLM.prompt_logits(engine=True)``)."""
        return self.head(self._forward(self._view(chunks)))

    def _merged_forward(self, decodes: tuple[DecodeRow, ...], whole: list[PassSlice], rows,
                        owners, scored: list[ScoredRows], fed: StepFeed) -> SavedRings | None:
        """Every decoder (with its draft) and every whole pass in one forward; returns the ring rows the
        drafts overwrite (``draft_rows``), saved before the forward, or None without drafts."""
        chunks = [SeqChunk(d.slot, d.position, (d.token, *d.draft), self.cache.block_table(d.slot)) for d in decodes]
        want = [_Owner(d.request_id, d.slot, d.sampler, d.draft, d.position, d.propose) for d in decodes]
        for p in whole:
            for m in p.members:
                chunks.append(self._member_chunk(m))
                want.append(_Owner(m.request_id, m.slot, m.sampler, propose=m.follow) if m.sample else None)
        spans = [DraftSpan(d.slot, d.position + 1, len(d.draft)) for d in decodes if d.draft]
        if spans and not self.sample and self.agree is None:
            raise StepError("drafts need the sampling rank's verification; this engine does not sample")
        saved = SavedRings(self.cache.state, spans) if spans else None
        view = self._view(chunks, self._merged_view)  # dropped at the step's end: its buffers serve the next
        capturing = self._captures(decodes, whole)
        graphs = self.decode.enabled and not whole and not spans and view.is_image is None and not capturing
        streams = self.decode.run(view, len(chunks)) if graphs else None
        if streams is None:
            into: dict[int, torch.Tensor] | None = {} if capturing else None
            streams = self._forward(view, into)
            if into is not None:
                fed.add([(c, d.request_id) for c, d in zip(chunks, decodes)]
                        + [(c, m.request_id) for c, m in zip(chunks[len(decodes):], [m for p in whole for m in p.members])],
                        self.capture.rows(into))
        ends = list(itertools.accumulate(len(c) for c in chunks))
        for e, m in zip(ends[len(decodes):], [m for p in whole for m in p.members]):
            keep_rows(m, streams, e - len(m.ids), scored)
        pick = [r for e, w in zip(ends, want) if w is not None for r in range(e - w.rows, e)]
        if pick:  # every row, in order (a decode-only step): the streams themselves, no gather
            rows.append(streams if len(pick) == ends[-1] else streams.index_select(0, torch.tensor(pick, device=self.device)))
            owners.extend(w for w in want if w is not None)
        return saved

    def _captures(self, decodes: tuple[DecodeRow, ...], whole: list[PassSlice]) -> bool:
        """Whether this step's merged forward splits for a checkpoint drafter's captures: when a prompt
        chunk the drafter follows runs (its context; ``PassMember.follow``: not where drafting could not pay
        at the batch's width) or a decoder follows, drafts or proposes (``DecodeRow.follow``).
        Otherwise the forward is a plain one: a step where the policy turned drafting off for everyone
        costs what it costs without a drafter (the rows it skips are positions the drafter's rings then
        lack; ``ModelDrafts`` drafts again only once they are whole)."""
        return self.drafts is not None and drafter_captures(decodes, whole)

    def _view(self, chunks, reuse: ViewReuse | None = None):
        return build_view(self.cache.layout, self.cache.n_slots, chunks, self.device,
                          max_image_tokens=self.cfg.vision.max_n_token, tiles=self.host is None, reuse=reuse)

    def _member_chunk(self, m: PassMember) -> SeqChunk:
        return SeqChunk(m.slot, m.start, m.ids, self.cache.block_table(m.slot), spans=m.spans, image_rows=m.image_rows,
                        captures=m.captures)

    def _advance(self, p: PassSlice, rows, owners, scored: list[ScoredRows], fed: StepFeed) -> PassProgress:
        """Run one layer slice of a multi-step pass, staging its hidden streams between steps."""
        st = self._passes.get(p.pass_id)
        if p.layer_start == 0:
            if st is not None:
                raise StepError(f"pass {p.pass_id} started twice")
            for m in p.members:
                if len(m.ids) > self.cache.staging_rows:
                    raise StepError(f"pass {p.pass_id}: {len(m.ids)} rows exceed the staging size "
                                    f"{self.cache.staging_rows}")
            view = self._view([self._member_chunk(m) for m in p.members])
            st = _PassState(members=p.members, view=view, rope=None, cursor=0,
                            follow=self.drafts is not None and any(m.follow for m in p.members))
            streams = None
        else:
            if st is None or st.cursor != p.layer_start:
                raise StepError(f"pass {p.pass_id}: slice starts at layer {p.layer_start}, "
                                f"cursor {None if st is None else st.cursor}")
            if tuple(m.request_id for m in st.members) != tuple(m.request_id for m in p.members):
                self._shrink(p, st)
            streams = self._load_staging(st.members)
        streams = self._layers(st, streams, p.layer_start, p.layer_stop)
        st.cursor = p.layer_stop
        if p.layer_stop < self.num_layers:
            self._passes[p.pass_id] = st
            self._store_staging(st.members, streams)
            return PassProgress(p.pass_id, st.cursor, False)
        self._passes.pop(p.pass_id, None)
        if st.follow:
            fed.add([(self._member_chunk(m), m.request_id) for m in st.members], self.capture.rows(st.captured))
        ends = (torch.cumsum(torch.tensor([len(m.ids) for m in p.members]), 0) - 1).tolist()
        for e, m in zip(ends, p.members):
            keep_rows(m, streams, e + 1 - len(m.ids), scored)
        pick = [e for e, m in zip(ends, p.members) if m.sample]
        if pick:
            rows.append(streams.index_select(0, torch.tensor(pick, device=self.device)))
            owners.extend(_Owner(m.request_id, m.slot, m.sampler, propose=m.follow) for m in p.members if m.sample)
        return PassProgress(p.pass_id, st.cursor, True)

    def _layers(self, st: _PassState, streams: torch.Tensor | None, start: int, stop: int) -> torch.Tensor:
        """Layers ``[start, stop)`` of a pass (from its embedding when ``streams`` is None); with a
        ``capture`` plan, the captured layers in the range land in ``st.captured``."""
        if (self.host is None or not self.host.takes(st.view)) and st.rope is None:
            st.rope = self.model.rope_tables(st.view)
        if st.follow:
            return self._captured(st.view, st.rope, streams, start, stop, st.captured)
        return self._segment(st.view, st.rope, streams, start, stop)

    def _captured(self, view: BatchView, rope: RopeTables | None, streams: torch.Tensor | None, start: int,
                  stop: int, into: dict[int, torch.Tensor]) -> torch.Tensor:
        """Layers ``[start, stop)`` with the ``capture`` plan's layers in the range landing in ``into``:
        natively in one call, else a torch forward split after each captured layer (bit-equal either way
        to the same layers run without captures)."""
        assert self.capture is not None
        if self.host is not None and self.host.takes(view):
            layers = self.capture.within(start, stop)
            streams, captured = self.host.forward_captured(view, layers, self.capture.mean_hc, start, stop, streams)
            self.capture.split(layers, captured, into)
            return streams
        return self.capture.run(functools.partial(self._segment, view, rope), streams, start, stop, into)

    def _shrink(self, p: PassSlice, st: _PassState) -> None:
        """Members left the pass (aborted): continue with the rest, re-indexed for their rows only."""
        before = [m.request_id for m in st.members]
        kept = [m.request_id for m in p.members]
        if not set(kept) <= set(before) or kept != [r for r in before if r in kept]:
            raise StepError(f"pass {p.pass_id}: members {kept} are not an ordered subset of {before}")
        if st.captured:  # the kept members' rows of what earlier slices captured
            starts = torch.cumsum(torch.tensor([0] + [len(m.ids) for m in st.members]), 0).tolist()
            rows = [r for i, m in enumerate(st.members) if m.request_id in kept
                    for r in range(starts[i], starts[i + 1])]
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            st.captured = {layer: t.index_select(0, index) for layer, t in st.captured.items()}
        st.members = p.members
        st.view = self._view([self._member_chunk(m) for m in p.members])
        st.rope = None

    def _store_staging(self, members, streams: torch.Tensor) -> None:
        offset = 0
        for m in members:
            n = len(m.ids)
            self.cache.staging[m.slot, :n].copy_(streams[offset:offset + n])
            offset += n

    def _load_staging(self, members) -> torch.Tensor:
        parts = [self.cache.staging[m.slot, :len(m.ids)] for m in members]
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts)

    def _sample(self, rows, owners: list[_Owner]) -> list[SampledToken]:
        """One token per owner, or for a decoder with a draft the accepted prefix and the target's token
        after it (``drafted.settle``): the LM head and the sampler run once over every row."""
        if not owners or not self.sample:
            return []
        streams = torch.cat(rows) if len(rows) > 1 else rows[0]
        logits = self.head(streams)
        if self.drafts is not None and self.drafts.rejection and any(o.draft for o in owners):
            return self._verify(logits, owners)
        draws = sample_rows(logits, [s for o in owners for s in row_states(o.sampler, o.draft, logits.device)])
        out, start = [], 0
        for o in owners:
            v = settle(draws[start:start + o.rows], o.draft)
            start += o.rows
            out.append(self._settled(o, v))
        return out

    def _settled(self, o: _Owner, v: Verified) -> SampledToken:
        tok = self._token(o, v.draw)
        return tok.with_run(v.accepted, v.accepted_logprobs) if v.accepted else tok

    def _verify(self, logits: torch.Tensor, owners: list[_Owner]) -> list[SampledToken]:
        """A model drafter's blocks: exact rejection sampling against the ``q`` each was drawn from
        (``spec_verify.verify_rows``; greedy requests: plain greedy decoding's tokens), every row once."""
        drafts = [self.drafts.take(o.slot, o.position, o.draft) if o.draft else Draft() for o in owners]
        mask = None  # a grammar's rows: its matcher advanced through the draft (``constraints.constrain``)
        if any(o.sampler.constraint is not None for o in owners):
            rstates = [s for o in owners for s in row_states(o.sampler, o.draft, logits.device)]
            mask = torch.isfinite(constrain(torch.zeros_like(logits), rstates))
        out = []
        for o, v in zip(owners, verify_rows(logits, [o.sampler for o in owners], drafts, mask)):
            if not v.ok:
                out.append(SampledToken(o.request_id, o.slot, -1, status=RowStatus.FAILED, error=v.error))
                log.error("request %s (slot %d): %s", o.request_id, o.slot, v.error)
                continue
            lps = tuple((d.logprob, d.top_logprobs or ()) if d.logprob is not None else None
                        for d in v.draws[:v.accepted])
            out.append(self._settled(o, Verified(v.tokens[:v.accepted], lps, v.draws[v.accepted])))
        return out

    @staticmethod
    def _token(owner: _Owner, d) -> SampledToken:
        if d.ok:
            return SampledToken(owner.request_id, owner.slot, d.token, logprob=d.logprob, top_logprobs=d.top_logprobs)
        log.error("request %s (slot %d): %s", owner.request_id, owner.slot, d.error)
        return SampledToken(owner.request_id, owner.slot, -1, status=RowStatus.FAILED, error=d.error)
