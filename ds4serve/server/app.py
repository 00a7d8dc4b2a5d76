"""The FastAPI application: middleware, error handlers, routes, and the engine loop's lifetime.

Everything slow runs elsewhere: the model in the engine-loop thread, templating / tokenizing /
image decoding in a worker pool. Every error body is OpenAI-shaped (``errors``; Anthropic-shaped on the
Messages API routes, ``anthropic_api``); every request has an id and one access log line
(``access_log``). The request path goes one way, down:
``routes`` -> ``jobs`` (validate, render) -> ``serving`` (admit, stream) -> ``runtime.EngineLoop``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .access_log import AccessLog
from .anthropic_api import install_anthropic_routes
from .errors import _error_response, install_error_handlers
from .limits import ServerLimits
from .middleware import Auth, BodyLimit
from .openapi import custom_openapi
from .router_api import install_router_routes
from .routes import install_routes
from .state import ServerState
from .webui import mount_webui

__all__ = ["ServerLimits", "ServerState", "_error_response", "create_app"]


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.on_step = state.metrics.on_step
        state.metrics.read_engine(lambda: state.loop.stats)
        state.loop.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.loop.shutdown)
        state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ds4serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for DeepSeek-V4 / DS4V models")
    app.state.ds4 = state
    app.openapi = lambda: custom_openapi(app)
    # the last added is the outermost: the access log sees the 401s and 413s of the layers inside it
    app.add_middleware(BodyLimit, limit=state.limits.max_body_bytes)
    app.add_middleware(Auth, keys=state.keys)
    app.add_middleware(AccessLog, metrics=state.metrics)
    install_error_handlers(app)
    install_routes(app)
    install_router_routes(app)
    install_anthropic_routes(app)
    mount_webui(app, enabled=state.limits.webui)
    return app
