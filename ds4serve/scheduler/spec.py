"""``RequestSpec``: what one request asks for, as one frozen record from the server to the scheduler.

A request used to cross four signatures on its way down (the server's job, ``EngineLoop.submit``,
``EngineCore.make_request``, ``Request``), each restating the same arguments, so every new per-request
field touched all four. Now the code that prepares a request (``server/jobs.py``, ``LLM``, the benches)
builds one ``RequestSpec`` and hands it down whole; the scheduler's ``Request`` holds it next to the
state that changes as the request runs. A field added here reaches the scheduler with no signature in
between changing, and keeps its name all the way down.

It lives in the scheduler package (the lowest layer that reads it) so the runtime, the server, ``LLM``
and the benches can all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.sampling import SamplingParams
from ..multimodal.records import ImageInput


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One request as its caller prepared it (one choice: ``n`` choices are ``n`` specs).

    Frozen: nothing below the code that builds it changes what was asked. ``constraint`` is the one
    exception in spirit: the grammar state object is the request's own (one per choice, never shared),
    and the sampler advances it from the request's output, but the spec still names the same object.
    Compared by identity: a spec is one request's, and field equality would compare image tensors and
    grammar matchers. Prompt logprobs ride in ``params.prompt_logprobs`` (the scoring count the engine computes); there
    is no per-request speculation switch: every decoder may draft (grammars included: a draft is cut
    where the request's grammar refuses it, ``engine.constraints.allowed_prefix``).
    """

    prompt_ids: tuple[int, ...]  # the ids the engine prefills, image placeholders already expanded
    params: SamplingParams
    images: tuple[ImageInput, ...] = ()  # DS4V: pixels + block layout at absolute positions, in order
    constraint: Any = None  # grammar state for the sampler (engine.constraints); None: free output
    cache_salt: str = ""  # prefix-cache tenant: hits only between requests of the same salt
    cache_points: tuple[int, ...] = ()  # extra prefix-snapshot positions (e.g. the end of the user turn)

    def __post_init__(self) -> None:
        """Accept any sequence (a list of ids, ``None`` for no images) and store tuples, so a caller's
        later change to its own list can never reach a request in flight (a tuple is kept as it is, so
        the ``n`` choices of one prompt share one)."""
        ids = tuple(self.prompt_ids)
        if not ids:
            raise ValueError("a request needs at least one prompt token; the prompt is empty")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, not {type(self.params).__name__}")
        object.__setattr__(self, "prompt_ids", ids)
        object.__setattr__(self, "images", tuple(self.images or ()))
        object.__setattr__(self, "cache_points", tuple(int(p) for p in self.cache_points))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


__all__ = ["RequestSpec"]
