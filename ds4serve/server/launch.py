"""``ds4serve serve``: load the model, start the engine loop, run uvicorn with a graceful shutdown.

Binding policy: loopback by default; any other address needs an API key (``--api-key`` /
``--api-key-file``, or an explicit ``--insecure-no-auth``). On SIGINT/SIGTERM every waiting client
is answered (an error saying the server is shutting down) before connections close.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from ..chat import Tokenizer
from ..chat.edition import choose_edition
from ..runtime import EngineLoop, load_core
from ..runtime.tp_group import ParallelSettings
from ..settings import EngineSettings
from .app import create_app
from .limits import ServerLimits
from .state import ServerState

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class BindError(ValueError):
    pass


def check_binding(host: str, api_key: str | Mapping[str, str] | None, insecure: bool) -> None:
    """``api_key``: the key, or the named keys; any key at all allows a non-loopback address."""
    if host not in LOOPBACK and not api_key and not insecure:
        raise BindError(f"refusing to listen on {host} without authentication: pass --api-key KEY "
                        "(or --insecure-no-auth if the network is trusted)")


def build_state(model_dir: Path, *, device: str = "cpu", dtype: str = "float32",
                settings: EngineSettings | None = None, limits: ServerLimits | None = None,
                api_key: str | None = None, api_keys: Mapping[str, str] | None = None,
                served_name: str | None = None,
                random_weights: bool = False, vision_device: str | None = None,
                image_hosts: tuple[str, ...] = (), packed_experts: bool | str = "auto",
                parallel: ParallelSettings | None = None, chat_encoding: str | None = None) -> ServerState:
    """``chat_encoding``: the effort edition (``--chat-encoding``); None: the checkpoint's (``chat.edition``)."""
    tokenizer = Tokenizer(model_dir)
    edition = choose_edition(model_dir, chat_encoding)  # before the weights load: a wrong name fails fast
    loop = EngineLoop(load_core(model_dir, device=device, dtype=dtype, settings=settings, vision_device=vision_device,
                                extra_eos=(tokenizer.eos_id,), packed_experts=packed_experts, parallel=parallel))
    # a rank died (tensor-parallel): stop the server (uvicorn's shutdown answers waiting clients)
    loop.on_rank_lost(lambda why: os.kill(os.getpid(), signal.SIGTERM))
    name = served_name or model_dir.name
    state = ServerState(loop=loop, tokenizer=tokenizer, model_id=name, limits=limits or ServerLimits(),
                        api_key=api_key, api_keys=api_keys, random_weights=random_weights,
                        chat_edition=edition.edition)
    log.info("chat encoding: effort prompts of edition %r (%s)", edition.edition, edition.reason)
    vision = loop.model_config.vision
    if vision.enabled:
        from ..multimodal.fetch import FetchPolicy  # noqa: PLC0415 - only for vision checkpoints
        from ..multimodal.pipeline import ImagePipeline  # noqa: PLC0415

        state.image_pipeline = ImagePipeline.for_model(loop.model_config, tokenizer, loop.limits.max_prefill_tokens,
                                                       FetchPolicy(allowed_hosts=image_hosts))
        log.info("images enabled: %d-token cap per image, remote URLs %s", vision.max_n_token,
                 f"from {', '.join(image_hosts)}" if image_hosts else "disabled (data: URLs only)")
    if random_weights:
        log.warning("serving %s with RANDOM placeholder weights (answers are noise): for tests and load runs; "
                    "the trained tiny DS4V is models/ds4v-tiny", name)
    return state


class _Server(uvicorn.Server):
    """Answer every waiting client before uvicorn starts waiting for connections to close."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.ds4 = state

    def handle_exit(self, sig, frame) -> None:
        self.ds4.loop.begin_shutdown("the server is shutting down")
        super().handle_exit(sig, frame)


def run(state: ServerState, host: str, port: int, log_level: str = "info") -> None:
    app = create_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=10,
                            access_log=False)
    log.info("serving %s on http://%s:%d (OpenAI API under /v1)", state.model_id, host, port)
    _Server(config, state).run()
