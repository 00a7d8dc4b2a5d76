"""The server's own knobs (the engine's are ``settings.EngineSettings``).

A module of its own, importing nothing, so the CLI can read these defaults to build its flags
without importing FastAPI or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

THINKING_MODES = ("on", "off")


@dataclass(frozen=True)
class ServerLimits:
    request_timeout_s: float = 600.0  # a request still running after this is cancelled (504 / error frame)
    keepalive_s: float = 10.0  # an SSE comment after this long without output keeps proxies from closing
    default_max_tokens: int = 1024  # when the client sends no max_tokens (capped by the context room)
    max_body_bytes: int = 48 * 2**20  # larger bodies are refused with 413 before they are read
    retry_after_s: int = 2  # the Retry-After of a 503 when the queue is full
    # DS4 thinking mode when a chat request does not say ("on" | "off"); "off" suits the bundled tiny
    # model, which was trained on chat-mode prompts only
    default_thinking: str = "off"
    webui: bool = True  # the chat page at / (serve --no-webui: a 404 there)

    def __post_init__(self) -> None:
        if self.default_thinking not in THINKING_MODES:
            raise ValueError(f"default_thinking must be one of {THINKING_MODES}, got {self.default_thinking!r}")
