"""Endpoints users script against: ``/tokenize``, ``/detokenize`` (vLLM's shapes) and
``/apply-template`` (llama.cpp's), plus ``GET /v1/models/{id}``.

They render exactly as a chat completion does (``jobs.render_prompt`` with the same chat controls),
so ``/tokenize`` returns the ids the engine prefills (image placeholders expanded into their blocks)
and ``/apply-template`` the string DeepSeek's reference encoder writes. Unlike a chat completion, a
conversation may end with an assistant message here (rendering a whole conversation is the point);
``response_format`` json modes are rendered too, since nothing is generated.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import ConfigDict, Field

from .jobs import chat_messages, chat_setup_of, completion_prompts, prompt_ids, render_prompt
from .protocol import MAX_MESSAGES, APIError, ChatControls, ChatMessage, ValidUnicode
from .state import ServerState, state_of


class _Strict(ValidUnicode, ChatControls):
    """Unknown fields are refused: a misspelled option would otherwise change nothing, silently."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=256)


class TokenizeRequest(_Strict):
    prompt: str | None = Field(default=None, max_length=4_000_000)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # a prompt: BOS first, as /v1/completions renders it (same flag there)
    return_token_strs: bool = False


class ApplyTemplateRequest(_Strict):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)


class DetokenizeRequest(_Strict):
    tokens: list[int] = Field(max_length=4_000_000)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_id:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    """Worker thread: the ids of a prompt (as /v1/completions) or of messages (as chat completions)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
    if body.prompt is not None:
        if any(v is not None for v in (body.chat_template_kwargs, body.thinking, body.reasoning_effort,
                                       body.tools, body.tool_choice, body.response_format)):
            raise APIError(400, "chat options need 'messages', not 'prompt'", param="prompt")
        if not body.prompt:
            return [state.tokenizer.bos_id] if body.add_special_tokens else []
        return completion_prompts(state, body.prompt, body.add_special_tokens)[0]
    return prompt_ids(state, chat_setup_of(state, body, chat_messages(body.messages)))[0]


async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = state_of(request)
    _check_model(state, body.model)
    ids = await state.run_blocking(_tokenize, state, body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.loop.limits.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [state.tokenizer.token_text(t) for t in ids]
    return out


async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state = state_of(request)
    _check_model(state, body.model)
    tok = state.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary (size {tok.vocab_size})", param="tokens")
    return {"prompt": await state.run_blocking(tok.decode, body.tokens, False)}


async def apply_template(body: ApplyTemplateRequest, request: Request) -> dict[str, str]:
    state = state_of(request)
    _check_model(state, body.model)
    setup = chat_setup_of(state, body, chat_messages(body.messages))
    rendered = await state.run_blocking(render_prompt, state, setup)
    return {"prompt": rendered.text}


def model_card(state: ServerState) -> dict[str, Any]:
    card = {"id": state.model_id, "object": "model", "created": int(state.started), "owned_by": "ds4serve",
            "max_model_len": state.loop.limits.max_model_len}
    if state.random_weights:
        card["ds4serve_note"] = ("random placeholder weights: answers are noise (the trained tiny DS4V is "
                                 "models/ds4v-tiny)")
    return card


async def model(model_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    if model_id != state.model_id:
        raise APIError(404, f"The model {model_id!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")
    return model_card(state)
