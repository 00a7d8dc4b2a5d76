"""The HTTP routes, one module-level function each; each reads the typed ``ServerState``.

A generation route does two things, each in one module below it: ``jobs`` validates and renders
the body into a ``Job`` (worker thread for the slow parts), ``serving.respond`` runs it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .jobs import build_chat, build_completion, new_request_id
from .middleware import key_name_of
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .responses_api import create_response, get_response
from .serving import respond
from .state import state_of
from .tokenize import apply_template, detokenize, model, model_card, tokenize


async def health(request: Request) -> Response | dict:
    if not state_of(request).loop.alive:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok"}


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type="text/plain; version=0.0.4")


async def models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(state_of(request))]}


async def chat(body: ChatCompletionRequest, request: Request) -> Response | dict:
    state = state_of(request)
    job = await build_chat(state, body, new_request_id("chat"), key_name_of(request))
    return await respond(state, job, request)


async def completions(body: CompletionRequest, request: Request) -> Response | dict:
    state = state_of(request)
    job = await build_completion(state, body, new_request_id("completion"), key_name_of(request))
    return await respond(state, job, request)


async def reset_prefix_cache(request: Request) -> dict:
    """Drop every prefix-cache snapshot (vLLM's route; behind the API key: it costs every tenant
    their hits). Runs on the engine thread between steps; snapshots that running requests still hold
    are the core's to keep."""
    state = state_of(request)
    if not state.loop.alive:
        raise APIError(503, "the engine is not available", type_="server_error", code="engine_unavailable")
    dropped = await state.run_blocking(state.loop.reset_prefix_cache)
    return {"reset": True, "snapshots_dropped": dropped}


def install_routes(app: FastAPI) -> None:
    routes = [("GET", "/health", health, "liveness: 200 when the engine is running"),
              ("GET", "/metrics", metrics, "Prometheus metrics"),
              ("GET", "/v1/models", models, "the served model"),
              ("GET", "/v1/models/{model_id}", model, "one model (404 for an id this server does not serve)"),
              ("POST", "/tokenize", tokenize, "prompt or messages -> token ids (vLLM's shape)"),
              ("POST", "/detokenize", detokenize, "token ids -> text (vLLM's shape)"),
              ("POST", "/apply-template", apply_template, "messages -> the rendered DS4 prompt (llama.cpp's shape)"),
              ("POST", "/v1/chat/completions", chat, "chat completions (streaming or not)"),
              ("POST", "/v1/completions", completions, "text completions (streaming or not)"),
              ("POST", "/v1/responses", create_response, "OpenAI Responses API (stateless; streaming or not)"),
              ("GET", "/v1/responses/{response_id}", get_response, "404: responses are not stored"),
              ("POST", "/reset_prefix_cache", reset_prefix_cache, "drop every prefix-cache snapshot (vLLM's route)")]
    for method, path, fn, summary in routes:
        app.add_api_route(path, fn, methods=[method], summary=summary, response_model=None)
