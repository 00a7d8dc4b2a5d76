"""What a router in front of several ``ds4serve serve`` replicas asks of each one, in its own shapes.

The router is vllm-router (``pip install vllm-router``; ``scripts/replicas.py`` starts it with N
replicas). It forwards the OpenAI routes as they are and, besides ``GET /health`` (``routes``), asks a
worker for:

- ``POST /v1/chat/completions/render`` (vLLM's render route): the prompt's token ids, before the
  request is sent anywhere (the router asks every worker, per request). Its ``cache_aware`` policy
  keeps a prefix tree of what each worker has seen and sends a request to the worker holding the
  longest match, so a conversation keeps landing where its prefix cache is. Without this route the
  router falls back to ``/tokenize`` (which refuses the ``continue_final_message`` field it adds) and
  then to the raw request text; with it, the tree is keyed on the ids this server's prefix cache is
  keyed on. Completions need nothing here: the router asks ``/tokenize`` with a ``prompt``, which
  answers in vLLM's shape already; requests with images it matches on their text, never asking.
- ``GET /get_load`` (SGLang's route, which vLLM-router polls for ``power_of_two`` and load
  balancing): ``{"load": N}`` with N the requests this replica holds (running, waiting, suspended,
  parked), plus the cache figures a dashboard wants (pages in use, prefix-cache bytes).
- ``GET /load`` (vLLM's): ``{"server_load": N}``, the same N.
- ``GET /get_model_info`` and ``GET /get_server_info`` (SGLang's): which model is served and how,
  what sglang-router's worker discovery asks every worker for when it registers it.

The render route sits under ``/v1`` and so behind the API keys like every generation route; the
load routes carry counts only (as ``/health`` does) and stay open, so a router without a key can
balance; the model and server info name the model, as ``/v1/models`` does, and so need a key when
the server has keys.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request

from ..runtime import EngineStats
from .jobs import chat_messages, chat_setup_of, render_prompt
from .protocol import APIError, ChatCompletionRequest
from .state import ServerState, state_of

# the engine's request states a replica is still answering for (``EngineStats.requests``)
_HELD = ("waiting", "prefilling", "decoding", "suspended", "parked")


def held_requests(stats: EngineStats) -> int:
    """Requests this replica has accepted and not yet finished: what a router balances on."""
    return sum(int(stats.requests.get(k, 0)) for k in _HELD)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_id:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")


def _check_key(request: Request) -> None:
    """The info routes name the model: on a server with keys, only a caller holding one may read them
    (the middleware guards ``/v1/*`` and its own list; these sit outside both)."""
    keys = state_of(request).keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    if keys.match(token) is None:
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                       code="invalid_api_key")


def _render_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    """Worker thread: the chat's prompt ids as the chat route renders them, image placeholders left
    unexpanded (the router only needs a key that grows with the conversation; decoding every image
    once per replica per request to expand them would cost more than it routes better)."""
    return list(render_prompt(state, chat_setup_of(state, body, chat_messages(body.messages))).ids)


async def render_chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
    """vLLM's ``/v1/chat/completions/render``: the request as token ids, nothing generated."""
    state = state_of(request)
    _check_model(state, body.model)
    ids = await state.run_blocking(_render_ids, state, body)
    params = {"max_tokens": body.max_completion_tokens or body.max_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "n": body.n}
    return {"request_id": f"render-{uuid.uuid4().hex}", "model": state.model_id, "token_ids": ids,
            "features": None, "sampling_params": {k: v for k, v in params.items() if v is not None},
            "stream": body.stream, "cache_salt": body.cache_salt}


async def get_load(request: Request) -> dict[str, Any]:
    """SGLang's ``/get_load`` as routers read it (``load``), with the queue and cache behind it."""
    s = state_of(request).loop.stats
    return {"load": held_requests(s), "num_reqs": s.running, "num_waiting_reqs": int(s.requests.get("waiting", 0)),
            "pages_in_use": s.pages_in_use, "pages_total": s.pages_total,
            "cache_usage": round(s.pages_in_use / s.pages_total, 6) if s.pages_total else 0.0,
            "prefix_cache_bytes": int(s.prefix.get("cached_bytes", 0)),
            "prefix_cache_snapshots": int(s.prefix.get("snapshots", 0))}


async def load(request: Request) -> dict[str, int]:
    """vLLM's ``/load``: the requests this replica is answering."""
    return {"server_load": held_requests(state_of(request).loop.stats)}


async def get_model_info(request: Request) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` (what its router names a worker's model by)."""
    _check_key(request)
    state = state_of(request)
    return {"model_path": state.model_id, "tokenizer_path": state.model_id, "is_generation": True,
            "served_model_name": state.model_id, "max_model_len": state.loop.limits.max_model_len,
            "has_image_understanding": state.image_pipeline is not None}


async def get_server_info(request: Request) -> dict[str, Any]:
    """SGLang's ``/get_server_info``: the served model and the engine's size (one data-parallel rank)."""
    _check_key(request)
    state = state_of(request)
    s = state.loop.stats
    return {"model_path": state.model_id, "served_model_name": state.model_id, "dp_size": 1,
            "max_total_num_tokens": state.loop.limits.max_model_len, "max_running_requests": s.slots_total,
            "prefix_cache_enabled": bool(s.prefix.get("enabled", 0)), "version": "ds4serve"}


def _errors(*codes: str) -> dict[str, Any]:
    """The error answers a route documents (the OpenAI error body ``openapi.custom_openapi`` defines)."""
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    return {code: {"description": _ERROR_DOCS[code], "content": body} for code in codes}


_ERROR_DOCS = {"400": "invalid request", "401": "missing or wrong API key (on a server with keys)",
               "404": "unknown model", "413": "request body too large", "500": "internal error"}


def install_router_routes(app: FastAPI) -> None:
    routes = [("POST", "/v1/chat/completions/render", render_chat, "chat -> prompt token ids, nothing generated "
               "(vLLM's render route; a router's prefix-aware policy keys on them)", ("400", "404", "413", "500")),
              ("GET", "/get_load", get_load, "requests held and cache use (SGLang's shape, which routers poll)", ()),
              ("GET", "/load", load, "requests held (vLLM's shape)", ()),
              ("GET", "/get_model_info", get_model_info, "the served model (SGLang's shape)", ("401",)),
              ("GET", "/get_server_info", get_server_info, "the served model and engine size (SGLang's shape)",
               ("401",))]
    for method, path, fn, summary, errors in routes:
        app.add_api_route(path, fn, methods=[method], summary=summary, response_model=None, responses=_errors(*errors))
