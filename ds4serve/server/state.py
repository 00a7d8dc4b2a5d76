"""What the server holds: one typed record that every route and helper reads.

The engine below is reached only through ``loop``, an ``EngineLoop``, by its named methods (``limits``,
``eos_ids``, ``submit``, ``alive``, ``stats``, ``reset_prefix_cache``, ...; never a core, a scheduler or
a cache: ``tests/test_architecture.py`` checks). Slow host work (templating, tokenizing, image
decoding) runs in ``executor`` so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from ..chat import Tokenizer
from ..chat.dsml import DEFAULT_EFFORT_EDITION
from ..runtime import EngineLoop
from .keys import ApiKeys
from .limits import ServerLimits
from .metrics import Metrics
from .protocol import APIError

if TYPE_CHECKING:
    from ..chat.template import RenderedPrompt
    from ..multimodal.pipeline import ImagePipeline, PreparedPrompt

T = TypeVar("T")


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Tokenizer
    model_id: str
    limits: ServerLimits = field(default_factory=ServerLimits)
    # the keys never show in a repr (logs, tracebacks): one key (named "key-1", the single-key API of
    # old) or several, {name: key}; not both
    api_key: str | None = field(default=None, repr=False)
    api_keys: Mapping[str, str] | None = field(default=None, repr=False)
    random_weights: bool = False
    chat_edition: str = DEFAULT_EFFORT_EDITION  # the checkpoint's effort prompts (``chat.edition``)
    metrics: Metrics = field(default=None)  # type: ignore[assignment]  # built for model_id when not given
    image_pipeline: ImagePipeline | None = None  # multimodal preprocessing (DS4V); None for text-only models
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "ds4serve-prep"))
    started: float = field(default_factory=time.time)
    _grammar: Any = field(default=None, repr=False)  # GrammarCompiler, built on first constrained request
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    keys: ApiKeys = field(init=False, repr=False)  # api_key / api_keys as one matcher (middleware.Auth)

    def __post_init__(self) -> None:
        self.keys = ApiKeys.of(self.api_key, self.api_keys)
        if self.metrics is None:
            self.metrics = Metrics(self.model_id)

    def grammar_compiler(self):
        """The served vocabulary's grammar compiler (built once, ~1 s at DS4's 129k tokens; any thread)."""
        with self._grammar_lock:
            if self._grammar is None:
                from ..chat.grammar_runtime import GrammarCompiler  # noqa: PLC0415 - only when asked for

                self._grammar = GrammarCompiler.for_tokenizer(self.tokenizer, vocab_size=self.loop.logits_width)
            return self._grammar

    async def run_blocking(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def prepare_images(self, rendered: RenderedPrompt) -> PreparedPrompt:
        """Decode, resize and expand the request's images (worker thread)."""
        from ..multimodal.images import ImageError  # noqa: PLC0415 - the leaf package imports PIL

        if self.image_pipeline is None:
            raise APIError(400, f"model {self.model_id!r} does not accept images; send text only",
                           param="messages", code="images_not_supported")
        try:
            return self.image_pipeline.prepare(rendered)
        except ImageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_image") from exc


def state_of(request: Request) -> ServerState:
    """The server state of the app serving ``request``."""
    return request.app.state.ds4
