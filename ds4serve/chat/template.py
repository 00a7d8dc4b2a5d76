"""DS4 chat encoding (spec ds4-vision §6.1): OpenAI messages -> token ids + image records.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜></think>

Non-thinking chat ends the prompt with ``</think>`` (thinking mode with ``<think>``). Earlier
assistant turns are closed with the end-of-sentence token; their reasoning is dropped. System and
developer messages are joined at the start. Content may be a string or a list of parts: text parts
are joined with a blank line and every image part becomes one ``<｜deepseek_image｜>`` placeholder,
in order (the images are returned alongside). A literal placeholder typed by a user is refused.
Tool results are rendered as user turns. The server renders with the full DS4 encoding
(``prompt.render_ds4``), which equals this one on the tiny model's training conversations; this
minimal form stays for the tiny model's training and evaluation tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tokenizer import IMAGE, Tokenizer


class ChatFormatError(ValueError):
    """The messages cannot be rendered; the message says what to fix (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class RenderedPrompt:
    ids: list[int]
    images: list[dict[str, Any]] = field(default_factory=list)  # image parts in placeholder order
    image_positions: list[int] = field(default_factory=list)  # index in ``ids`` of each placeholder


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def render_chat(tok: Tokenizer, messages: list[dict[str, Any]], thinking: bool = False) -> RenderedPrompt:
    if not messages:
        raise ChatFormatError("messages must contain at least one message", "messages")
    out = RenderedPrompt(ids=[tok.bos_id])
    systems = [m for m in messages if m.get("role") in ("system", "developer")]
    for i, m in enumerate(messages):
        if m.get("role") not in _ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {m.get('role')!r}",
                                  f"messages[{i}].role")
    if systems:
        texts = [_text_only(tok, m, messages.index(m)) for m in systems]
        _append_text(tok, out, "\n\n".join(t for t in texts if t))
    turns = [(i, m) for i, m in enumerate(messages) if m["role"] not in ("system", "developer")]
    if not turns:
        raise ChatFormatError("messages need at least one user message", "messages")
    if turns[-1][1]["role"] == "assistant":
        raise ChatFormatError("the last message must not be an assistant message (continuation is not "
                              "supported)", f"messages[{turns[-1][0]}]")
    for i, m in turns:
        if m["role"] in ("user", "tool"):
            out.ids.append(tok.user_id)
            _append_parts(tok, out, m, i)
        else:
            out.ids.extend((tok.assistant_id, tok.think_end_id))
            _append_text(tok, out, _text_only(tok, m, i))
            out.ids.append(tok.eos_id)
    out.ids.append(tok.assistant_id)
    if thinking:
        if tok.think_id is None:
            raise ChatFormatError("this model's tokenizer has no <think> token; thinking mode is unavailable")
        out.ids.append(tok.think_id)
    else:
        out.ids.append(tok.think_end_id)
    return out


def _check_injection(text: str, where: str) -> None:
    if IMAGE in text:
        raise ChatFormatError(f"{where} contains the reserved image placeholder {IMAGE!r}; send images as "
                              "image_url content parts instead", where)


def _text_only(tok: Tokenizer, m: dict, i: int) -> str:
    content = m.get("content")
    if m.get("reasoning_content") is not None:
        _check_injection(str(m["reasoning_content"]), f"messages[{i}].reasoning_content")
    if content is None:
        return ""
    if isinstance(content, str):
        _check_injection(content, f"messages[{i}].content")
        return content
    parts = []
    for j, p in enumerate(_parts(content, i)):
        if p.get("type") != "text":
            raise ChatFormatError(f"messages[{i}].content[{j}]: a {m['role']} message may only contain text parts",
                                  f"messages[{i}].content[{j}].type")
        _check_injection(p.get("text", ""), f"messages[{i}].content[{j}].text")
        parts.append(p.get("text", ""))
    return "\n\n".join(parts)


def _parts(content: Any, i: int) -> list[dict]:
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ChatFormatError(f"messages[{i}].content must be a string or a list of content parts",
                              f"messages[{i}].content")
    return content


def _append_parts(tok: Tokenizer, out: RenderedPrompt, m: dict, i: int) -> None:
    content = m.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
        _check_injection(text, f"messages[{i}].content")
        _append_text(tok, out, text)
        return
    blocks: list[str | dict] = []
    for j, p in enumerate(_parts(content, i)):
        kind = p.get("type")
        if kind == "text":
            _check_injection(p.get("text", ""), f"messages[{i}].content[{j}].text")
            blocks.append(p.get("text", ""))
        elif kind in ("image_url", "image", "input_image"):
            blocks.append(p)
        else:
            raise ChatFormatError(f"messages[{i}].content[{j}].type {kind!r} is not supported (use text or "
                                  "image_url)", f"messages[{i}].content[{j}].type")
    for k, b in enumerate(blocks):
        if k:
            _append_text(tok, out, "\n\n")
        if isinstance(b, str):
            _append_text(tok, out, b)
        else:
            if tok.image_id is None:
                raise ChatFormatError("this model does not accept images", f"messages[{i}].content")
            out.image_positions.append(len(out.ids))
            out.ids.append(tok.image_id)
            out.images.append(b)


def _append_text(tok: Tokenizer, out: RenderedPrompt, text: str) -> None:
    out.ids.extend(tok.encode_text(text))


def render_completion(tok: Tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """A raw completion prompt, tokenized as vLLM and llama-server do: special-token text in it
    (``<｜User｜>``, ``<｜Assistant｜>``, ...) becomes that token, because a completions client writes the
    whole prompt, chat markup included (lm-eval's ``--apply_chat_template`` renders the DS4 encoding
    and sends it here). BOS goes first unless ``add_special_tokens`` is false (vLLM's flag) or the
    prompt already starts with BOS text: a rendered chat prompt carries its own, and a second BOS is a
    sequence the model never saw in training. The image placeholder is still refused: without an
    image behind it, it would prefill an image slot with nothing."""
    _check_injection(prompt, "prompt")
    ids = tok.encode_markup(prompt)
    if add_special_tokens and ids[:1] != [tok.bos_id]:
        ids.insert(0, tok.bos_id)
    return ids
