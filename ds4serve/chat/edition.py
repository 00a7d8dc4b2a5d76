"""Which reasoning-effort edition (``dsml.EFFORT_PROMPTS``) a checkpoint was trained with.

DeepSeek changed the effort prompts between releases: the first DeepSeek-V4-Flash encoder has one
prefix ("Absolute maximum", for ``max``), the Vision-Exp / 0731 encoder two ("Absolute maximum" for
``high``, "Beyond maximum" for ``max``). A prompt from the wrong edition is text the checkpoint never
saw, so the edition follows the checkpoint, decided once at start-up, first rule that answers:

1. ``--chat-encoding`` (an operator's override);
2. the checkpoint's own ``encoding/`` folder (DeepSeek ships its encoder there): the string constants
   of its ``.py`` files, read with ``ast`` and never imported or run (a checkpoint folder is data,
   not code this server trusts), compared with each edition's prompts;
3. what ``config.json`` says the checkpoint is: a vision checkpoint (DS4V, Vision-Exp) or a name
   with ``0731`` is the later edition, a name of the first DeepSeek-V4 release the first one;
4. the default, ``dsml.DEFAULT_EFFORT_EDITION`` (the later edition, also vLLM's).

The reason is kept with the edition so the start-up log can say why.
"""

from __future__ import annotations

import ast
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dsml import DEFAULT_EFFORT_EDITION, EFFORT_PROMPTS

log = logging.getLogger(__name__)

#: files larger than this, or past this many, are not read (an encoder is a few tens of kB)
MAX_FILE_BYTES = 4 * 2**20
MAX_FILES = 64
EFFORT_MARK = "Reasoning Effort:"
EDITIONS = tuple(EFFORT_PROMPTS)


class EditionError(ValueError):
    """An unknown ``--chat-encoding`` name."""


@dataclass(frozen=True)
class EditionChoice:
    """The effort edition a server renders with and the sentence saying why."""
    edition: str
    reason: str


def _folded(node: ast.AST) -> str | None:
    """A string constant, including ``"a" "b"`` (one constant already) and ``"a" + "b"`` chains."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _folded(node.left), _folded(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def string_constants(source: str) -> set[str]:
    """Every string constant in Python ``source``, parsed, never executed (``SyntaxError`` propagates)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        text = _folded(node)
        if text is not None:
            out.add(text)
    return out


def _encoder_strings(folder: Path) -> tuple[set[str], list[str]]:
    """String constants of the ``.py`` files under ``folder`` and the files they came from."""
    strings: set[str] = set()
    read: list[str] = []
    for path in sorted(folder.rglob("*.py"))[:MAX_FILES]:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            strings |= string_constants(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, RecursionError) as exc:
            log.warning("chat encoding: %s is not readable Python (%s); its strings are not used", path, exc)
            continue
        read.append(path.relative_to(folder).as_posix())
    return strings, read


def from_encoding_folder(model_dir: Path) -> EditionChoice | None:
    """The edition whose effort prompts the checkpoint's ``encoding/`` folder holds; None when there
    is no such folder or it names no effort prompt this server knows (then a warning says so)."""
    folder = model_dir / "encoding"
    if not folder.is_dir():
        return None
    strings, files = _encoder_strings(folder)
    found = {s.strip() for s in strings if EFFORT_MARK in s}
    if not found:
        return None
    where = f"{folder} ({', '.join(files)})"
    matches = [e for e in EDITIONS if _prompts(e) and _prompts(e) <= found]
    if matches:  # the edition with the most prompts found: the later one also holds the earlier's text
        best = max(matches, key=lambda e: len(_prompts(e)))
        return EditionChoice(best, f"the checkpoint's encoder {where} holds its effort prompts")
    log.warning("chat encoding: the effort prompts in %s match no known edition (%s); falling back to the "
                "config", where, ", ".join(EDITIONS))
    return None


def _prompts(edition: str) -> set[str]:
    return {p.strip() for p in EFFORT_PROMPTS[edition].values() if p}


def from_config(config: dict[str, Any]) -> EditionChoice | None:
    """The edition ``config.json`` implies: vision checkpoints (DS4V, DeepSeek-V4-Flash-Vision-Exp)
    and 0731 names are the later edition; a DeepSeek-V4 name without either the first release."""
    layers = config.get("vision_n_layers")
    vision = (isinstance(layers, int) and layers > 0) or config.get("model_type") in ("deepseek_v4_vl",
                                                                                      "deepseek_v4_vision")
    if vision:
        return EditionChoice("v4-vision", "config.json describes a vision checkpoint (the Vision-Exp encoder's "
                                          "edition)")
    names = [str(config.get(k)) for k in ("_name_or_path", "name_or_path", "ds4serve_checkpoint") if config.get(k)]
    for name in names:
        if "0731" in name:
            return EditionChoice("v4-vision", f"config.json names a 0731 checkpoint ({name!r})")
    for name in names:
        if "deepseek-v4" in name.lower():
            return EditionChoice("v4", f"config.json names a first-release DeepSeek-V4 checkpoint ({name!r})")
    return None


def choose_edition(model_dir: Path, override: str | None = None) -> EditionChoice:
    """The edition to render ``model_dir``'s prompts with, by the rules of the module docstring."""
    if override is not None:
        if override not in EDITIONS:
            raise EditionError(f"--chat-encoding {override!r} is not one of {', '.join(EDITIONS)}")
        return EditionChoice(override, "set by --chat-encoding")
    found = from_encoding_folder(model_dir)
    if found is not None:
        return found
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    found = from_config(config) if isinstance(config, dict) else None
    if found is not None:
        return found
    return EditionChoice(DEFAULT_EFFORT_EDITION, "the default (no encoding/ folder and nothing in config.json "
                                                 "names the release)")
