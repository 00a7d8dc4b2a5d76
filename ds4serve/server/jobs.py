"""From a validated request body to a ``Job``: checks, rendering, images, sampling parameters.

Rendering, tokenizing and image decoding run in the worker pool (``state.run_blocking``), never on
the event loop; by the end the prompt length is known exactly and every refusal a client can fix
has been a 4xx. What the engine runs is built here, once: one ``RequestSpec`` per choice, handed
down whole by ``serving.admit``, where ``EngineLoop.submit`` asks ``fit`` whether it can ever run (a
400 before any stream opens). A job then goes to ``serving.respond``; nothing here runs the engine.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..chat import ChatFormatError, DS4Prompt, render_completion, render_ds4
from ..multimodal.records import ImageInput
from ..runtime import RequestSpec, RequestStream, SamplingError, SamplingParams
from . import constrained
from .chat_request import ChatSetup, chat_setup, check_generation
from .keys import tenant_salt
from .protocol import (APIError, ChatCompletionRequest, ChatControls, ChatMessage, CompletionRequest, SamplingFields,
                       check_extra_fields)
from .state import ServerState

if TYPE_CHECKING:
    from .access_log import RequestRecord


@dataclass
class Job:
    """A validated request ready to run: ``specs`` (what the engine runs, one per choice) and how its
    answer is shaped (stops, logprobs, streaming, usage, the chat parser)."""

    kind: Literal["chat", "completion"]
    request_id: str
    specs: list[RequestSpec]  # one per choice (index = prompt_index * n + i), handed to the engine whole
    n: int
    stops: list[str]
    skip_special: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    arrival: float
    chat: ChatSetup | None = None  # a chat job: how its output is parsed (reasoning, content, tool calls)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    streams: list[RequestStream] = field(default_factory=list)  # accepted engine requests, one per choice
    record: RequestRecord | None = None  # the request's access-log record (None outside HTTP)
    cancelled: str | None = None  # why the server stopped it early, once it has
    finished_choices: int = 0  # choices whose finish reason the consumer has seen
    key_name: str = ""  # the API key's name ("" without keys): the metrics label and the salt's tenant part
    cached: list[int] = field(default_factory=list)  # per choice: prompt tokens from the prefix cache
    echo: bool = False  # completions: the prompt's text (and logprobs) before the output (prompt_echo.py)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top N, None when not asked

    @property
    def prompts(self) -> list[tuple[int, ...]]:
        """The prompts, one per ``n`` choices (each choice's spec holds its prompt)."""
        return [self.specs[i].prompt_ids for i in range(0, len(self.specs), self.n)]

    @property
    def params(self) -> list[SamplingParams]:
        """Each choice's sampling parameters (from its spec)."""
        return [s.params for s in self.specs]

    @property
    def log_id(self) -> str:
        """The id that names this request in log lines: its HTTP request id when it has one."""
        return self.record.request_id if self.record is not None else self.request_id

    def note_cached(self, index: int, tokens: int) -> None:
        """Choice ``index`` got ``tokens`` of its prompt from the prefix cache (every output says it)."""
        if not self.cached:
            self.cached = [0] * len(self.params)
        self.cached[index] = tokens

    def cached_tokens(self) -> int:
        """``usage.prompt_tokens_details.cached_tokens``: per prompt, the least its choices got from the
        cache (usage counts a prompt once however many choices ran it, so this never exceeds it)."""
        if not self.cached:
            return 0
        return sum(min(self.cached[p * self.n:(p + 1) * self.n]) for p in range(len(self.prompts)))


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None, choice: int,
                    stop_ids: tuple[int, ...], bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    """``bias``: the request's ``logit_bias`` as ``logit_bias_of`` checked it against the vocabulary."""
    seed = None if body.seed is None else (body.seed + choice) % 2**63
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, min_p=body.min_p or 0.0,
            seed=seed, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=min(body.min_tokens, max_tokens),
            stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, logprobs=logprobs, logit_bias=bias)
    except SamplingError as exc:
        raise APIError(400, str(exc)) from exc


def _check_model(state: ServerState, body: SamplingFields) -> None:
    if body.model != state.model_id:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_id!r}",
                       type_="invalid_request_error", param="model", code="model_not_found")


def _max_tokens(state: ServerState, requested: int | None, prompt_len: int) -> int:
    """The client's ``max_tokens``, else the server's default within the room the prompt leaves in the
    context and in the page pool (at least 1: a prompt that leaves none is then refused by ``fit`` on
    submit, which says which limit it fills). Not a fit check itself: the server has one door, submit."""
    if requested is not None:
        return requested
    lim = state.loop.fit_limits
    room = min(lim.max_model_len, lim.n_pages * lim.page_tokens) - prompt_len
    return min(state.limits.default_max_tokens, max(room, 1))


def _stop_ids(state: ServerState, body: SamplingFields) -> tuple[int, ...]:
    ids = tuple(body.stop_token_ids or ())
    bad = [i for i in ids if not 0 <= i < state.tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids {bad} are outside the vocabulary", param="stop_token_ids")
    return ids


def logit_bias_of(state: ServerState, body: SamplingFields) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs, sorted; a key that is not a token id of this vocabulary or
    a bias outside [-100, 100] is a 400 naming it (OpenAI's rules: a silently dropped entry would let a
    ban the client relies on pass unnoticed)."""
    pairs = []
    vocab = state.tokenizer.vocab_size
    for key, bias in (body.logit_bias or {}).items():
        text = key.strip()
        if re.fullmatch(r"-?[0-9]+", text) is None:
            raise APIError(400, f"logit_bias key {key!r} is not a token id; keys are token ids written as decimal "
                           "strings, e.g. {\"50256\": -100}", param="logit_bias")
        token = int(text)
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(400, f"logit_bias for token {token} is {bias:g}; a bias must be in [-100, 100]",
                           param="logit_bias")
        pairs.append((token, float(bias)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise APIError(400, "logit_bias names the same token id twice", param="logit_bias")
    return tuple(sorted(pairs))


def _include_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _continuous_usage(body: SamplingFields) -> bool:
    """Usage on every chunk of a stream (a non-streaming answer always carries its usage)."""
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as plain dicts (what the encoder reads), unset fields left out."""
    return [m.model_dump(exclude_none=True) for m in messages]


def chat_setup_of(state: ServerState, body: ChatControls, messages: list[dict]) -> ChatSetup:
    """``chat_request.chat_setup`` with this server's default thinking mode and effort edition."""
    return chat_setup(body, messages, state.limits.default_thinking == "on", state.chat_edition)


async def build_chat(state: ServerState, body: ChatCompletionRequest, request_id: str, key_name: str = "") -> Job:
    """``key_name``: the API key's name, whose prefix-cache entries alone this request may reuse."""
    check_extra_fields(body, "chat.completions")
    _check_model(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    setup = chat_setup_of(state, body, chat_messages(body.messages))
    check_generation(setup)
    continuous = _continuous_usage(body)
    prompt, images = await state.run_blocking(prompt_ids, state, setup)
    max_tokens = _max_tokens(state, body.max_completion_tokens or body.max_tokens, len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    stop_ids, bias = _stop_ids(state, body), logit_bias_of(state, body)
    grammar = constrained.spec_of(setup, body)
    budget = constrained.reasoning_budget(setup, body.max_reasoning_tokens, max_tokens, grammar is not None)
    params = [dataclasses.replace(sampling_params(body, max_tokens, logprobs, i, stop_ids, bias),
                                  max_reasoning_tokens=budget, prompt_logprobs=body.prompt_logprobs)
              for i in range(body.n)]
    grammars = await state.run_blocking(constrained.matchers, state, setup, grammar, body.n, budget)
    salt, points, ids = tenant_salt(key_name, body.cache_salt), user_turn_end(state, setup, prompt), tuple(prompt)
    specs = [RequestSpec(ids, p, images, g, salt, points) for p, g in zip(params, grammars)]
    return Job("chat", request_id, specs, body.n, body.stop_list(), body.skip_special_tokens, logprobs,
               body.stream, _include_usage(body), time.monotonic(), chat=setup, continuous_usage=continuous,
               key_name=key_name, prompt_logprobs=body.prompt_logprobs)


def user_turn_end(state: ServerState, setup: ChatSetup, prompt: list[int]) -> tuple[int, ...]:
    """In thinking mode the prompt ends ``<｜Assistant｜><think>``, but the next turn renders this
    answer with its reasoning dropped (``<｜Assistant｜></think>answer``), so the two prompts part just
    before the ``<think>``. A snapshot there (``len - 1``) lets the next turn reuse everything up to
    the end of this user turn; the snapshot at the prompt's end would never match it."""
    think = state.tokenizer.think_id
    if setup.options.thinking and think is not None and len(prompt) > 1 and prompt[-1] == think:
        return (len(prompt) - 1,)
    return ()


def render_prompt(state: ServerState, setup: ChatSetup) -> DS4Prompt:
    """The DS4 encoding of the chat (worker thread). Every model served is templated this way: the
    bundled tiny model was trained on exactly the DS4 chat-mode prompts (``chat.render_chat``'s
    single-turn form equals ``render_ds4`` there, tested), so it keeps answering as before."""
    try:
        return render_ds4(state.tokenizer, setup.messages, setup.options)
    except ChatFormatError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def prompt_ids(state: ServerState, setup: ChatSetup) -> tuple[list[int], list[ImageInput] | None]:
    """Worker thread: the prompt ids the engine prefills, every image placeholder expanded into its block."""
    rendered = render_prompt(state, setup)
    if not rendered.images:
        return rendered.ids, None
    prepared = state.prepare_images(rendered)
    return prepared.ids, prepared.images or None


async def build_completion(state: ServerState, body: CompletionRequest, request_id: str,
                           key_name: str = "") -> Job:
    """``key_name``: as for ``build_chat``."""
    check_extra_fields(body, "completions")
    _check_model(state, body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of not in (None, 1):
        raise APIError(400, "best_of other than 1 is not supported", param="best_of", code="unsupported_parameter")
    prompts = await state.run_blocking(completion_prompts, state, body.prompt, body.add_special_tokens)
    if len(prompts) * body.n > 64:
        raise APIError(400, "at most 64 choices (prompts x n) per request", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo=true, to score the prompt)",
                       param="max_tokens")
    max_tokens = _max_tokens(state, body.max_tokens, max(len(p) for p in prompts))
    stop_ids, bias = _stop_ids(state, body), logit_bias_of(state, body)
    logprobs = body.logprobs
    scored = prompt_scoring(body.prompt_logprobs, logprobs if body.echo else None)
    salt = tenant_salt(key_name, body.cache_salt)
    specs = [RequestSpec(ids, dataclasses.replace(sampling_params(body, max_tokens, logprobs, i, stop_ids, bias),
                                                  prompt_logprobs=scored), cache_salt=salt)
             for ids in map(tuple, prompts) for i in range(body.n)]
    return Job("completion", request_id, specs, body.n, body.stop_list(), body.skip_special_tokens,
               logprobs, body.stream, _include_usage(body), time.monotonic(), continuous_usage=_continuous_usage(body),
               key_name=key_name, echo=body.echo, prompt_logprobs=body.prompt_logprobs)


def prompt_scoring(prompt_logprobs: int | None, echo_logprobs: int | None) -> int | None:
    """How many alternatives the engine reports per prompt token: enough for vLLM's ``prompt_logprobs``
    and for echo with ``logprobs`` (None: the prompt is not scored, so its prefill may hit the cache)."""
    asked = [n for n in (prompt_logprobs, echo_logprobs) if n is not None]
    return max(asked) if asked else None


def completion_prompts(state: ServerState, prompt: str | list, add_special_tokens: bool = True) -> list[list[int]]:
    """Ids of each completion prompt: text through ``render_completion`` (BOS unless
    ``add_special_tokens`` is false), token-id prompts as sent."""
    tok = state.tokenizer
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        try:
            ids = render_completion(tok, p, add_special_tokens) if isinstance(p, str) else list(p)
        except ChatFormatError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        if not ids or (isinstance(p, str) and not p):
            raise APIError(400, f"prompt[{i}] is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"prompt[{i}] has token ids outside the vocabulary: {bad[:5]}", param="prompt")
        out.append(ids)
    return out
