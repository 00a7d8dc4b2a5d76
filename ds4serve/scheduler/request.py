"""One request's state: its spec, a status enum that only the scheduler changes, and what is derived from it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..engine.encoder import ImageState
from ..engine.sampling import SamplerState, SamplingParams
from ..multimodal.records import ImageInput, ImageSpan
from .spec import RequestSpec


class RequestStatus(str, Enum):
    WAITING = "waiting"  # queued; holds no slot or pages
    PREFILLING = "prefilling"  # holds a slot; more than one input token still to feed
    DECODING = "decoding"  # holds a slot; feeds its last sampled token each step
    SUSPENDED = "suspended"  # state copied to host memory; no slot or pages
    PARKED = "parked"  # state dropped; will be recomputed from its retained input
    FINISHED_STOP = "finished_stop"  # EOS or a stop token id
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context limit
    FINISHED_ABORT = "finished_abort"  # cancelled by the client (or timed out)
    FINISHED_ERROR = "finished_error"  # failed alone; ``error`` says why

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOP: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORT: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (streamed to its caller)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None  # per new token
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache (fixed at admission)
    # prompt logprobs (``SamplingParams.prompt_logprobs``), on the request's first output only: one per prompt
    # token, None for the first (nothing predicts it), then (logprob, rank, ((token, logprob), ...) best first)
    prompt_logprobs: tuple[tuple[float, int, tuple[tuple[int, float], ...]] | None, ...] | None = None


@dataclass
class Request:
    """A request in the scheduler: its ``RequestSpec`` (what was asked, never changed) and the state that
    changes as it runs. The spec's fields are read through it (``req.params`` is ``req.spec.params``)."""

    request_id: str
    spec: RequestSpec
    eos_ids: tuple[int, ...] = ()
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    slot: int | None = None
    computed: int = 0  # input positions whose state is in the cache
    pass_id: int | None = None  # the multi-step pass this request is in
    suspended: Any = None  # SuspendedSeq while SUSPENDED (its rows and pages on the host)
    error: str | None = None
    preemptions: int = 0
    first_token_at: float | None = None
    images_submitted: bool = False  # its images are with the encoder worker (rows retained while live)
    image_bytes: int = 0  # retained-rows memory accounted to this request
    suspect: int | None = None  # suspect group after a failed step (see isolation.py); None: not suspect
    clear_at: int = 0  # a suspect is cleared once ``computed`` reaches this (past its failed step)
    cached_tokens: int = 0  # prompt tokens served by a prefix-cache hit at first admission
    first_image: int = 0  # images before this index lie under that hit: never sent to the encoder
    prefix: Any = None  # the scheduler's prefix-cache bookkeeping (scheduler.reuse.PrefixState)
    # speculative decoding (scheduler.drafting): the chance that a draft token is accepted once the tokens
    # before it were (``draft_hits / (draft_hits + draft_stops)``, decayed sums of accepted tokens and of
    # drafts that stopped at a rejection), and counts
    draft_rate: float = 1.0
    draft_hits: float = 1.0
    draft_stops: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_skipped: int = 0  # steps its rate did not pay for a draft (scheduler.drafting's probe counts them)
    proposal: tuple[int, ...] = ()  # a model drafter's block, drafted for the decode row at ``proposal_at``
    proposal_at: int = -1
    proposal_survival: tuple[float, ...] = ()  # the drafter's confidence product at each block position
    # the latest position a step fed without a checkpoint drafter capturing it (its rings lack it until
    # ``window`` positions later; -1: none known): ``DraftPolicy`` stops following where they never catch up
    unfollowed_at: int = -1
    # decayed sums of the tokens its model drafts got accepted and of the survival estimates of those rows
    # (scheduler.drafting.record): how far the drafter's estimates are to be believed for this request
    survival_hits: float = 0.0
    survival_expected: float = 0.0
    ngram: Any = None  # its prompt-lookup index (engine.ngram.SuffixIndex), made at its first n-gram draft
    # prompt logprobs as the prefill steps report them: entry i scores prompt token i + 1 (engine.plan's
    # PromptLogprobs); delivered with the first output (``prompt_lp_sent``), never computed again after that
    prompt_lp: list = field(default_factory=list)
    prompt_lp_sent: bool = False
    # the spec's prompt as a list, made once here: the drafter joins a slice of it with output (a list)
    prompt_ids: list[int] = field(init=False)
    sampler: SamplerState = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, RequestSpec):
            raise TypeError(f"request {self.request_id}: spec must be a RequestSpec, not {type(self.spec).__name__}")
        self.prompt_ids = list(self.spec.prompt_ids)
        self.sampler = SamplerState(self.params, self.prompt_ids, self.output_ids, self.eos_ids,
                                    constraint=self.constraint)

    # ---- the spec's fields, read through (one record holds them) ------------------------------
    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def images(self) -> tuple[ImageInput, ...]:
        """DS4V: pixels + block layout at absolute positions (empty: a text request)."""
        return self.spec.images

    @property
    def constraint(self) -> Any:
        return self.spec.constraint

    @property
    def cache_salt(self) -> str:
        return self.spec.cache_salt

    @property
    def cache_points(self) -> tuple[int, ...]:
        return self.spec.cache_points

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def survival_scale(self) -> float:
        """How much its model drafter's survival estimates are worth: accepted tokens per estimated one
        over its recent drafts, from a pseudo-record of one estimated token accepted (so a new request
        believes its drafter), within ``[0.1, 2]``."""
        return min(2.0, max(0.1, (self.survival_hits + 1.0) / (self.survival_expected + 1.0)))

    @property
    def pending(self) -> int:
        """Input tokens not yet in the cache (1 for a decoder: its last sampled token)."""
        return self.total_len - self.computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not had them yet: its prefill scores every prompt row."""
        return self.params.prompt_logprobs is not None and not self.prompt_lp_sent

    def input_ids(self, start: int, stop: int) -> tuple[int, ...]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return tuple(self.prompt_ids[start:stop])
        return tuple(self.prompt_ids[start:]) + tuple(self.output_ids[max(0, start - n_prompt):stop - n_prompt])

    @property
    def spans(self) -> tuple[ImageSpan, ...]:
        """Image blocks (absolute positions), in order."""
        return tuple(im.span for im in self.images) if self.images else ()

    @property
    def live_spans(self) -> tuple[ImageSpan, ...]:
        """Spans of the images the encoder was (or will be) asked for: those past a prefix hit."""
        return self.spans[self.first_image:]

    def recomputable_from(self, images: Sequence[ImageState]) -> bool:
        """Its whole input is retained: token ids, and the rows of every image already encoded
        (``images``: what the encoder says of this request's images now).

        Only retained *rows* count (nothing re-encodes retained pixels), and an image still in the
        encoder is fine: a recompute waits for its rows like the first prefill did. A request whose
        rows are gone (or whose image failed) is never rebuilt from its sentinel ids alone."""
        if not self.images:
            return True
        return self.images_submitted and all(im.retained for im in images)
