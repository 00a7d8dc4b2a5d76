"""The effort-prompt edition follows the checkpoint: its ``encoding/`` folder (string constants read
with ``ast``, never run), else its config, else the default; ``--chat-encoding`` overrides, and the
start-up log says which edition and why."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from ds4serve.chat.dsml import DEFAULT_EFFORT_EDITION, EFFORT_PROMPTS
from ds4serve.chat.edition import (EditionError, choose_edition, from_config, from_encoding_folder,
                                   string_constants)
from server_harness import serve

ABSOLUTE, BEYOND = EFFORT_PROMPTS["v4-vision"]["high"], EFFORT_PROMPTS["v4-vision"]["max"]


def _chunks(text: str, size: int = 40) -> str:
    """``text`` as an implicitly concatenated Python literal, the way encoders write long prompts."""
    return "(\n" + "\n".join("    " + repr(text[i:i + size]) for i in range(0, len(text), size)) + "\n)"


def _encoder(folder: Path, body: str, marker: Path) -> Path:
    """A checkpoint folder whose ``encoding/`` module would write ``marker`` if it were ever run."""
    (folder / "encoding").mkdir(parents=True, exist_ok=True)
    (folder / "encoding" / "encoding_dsv4.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write('ran')\nos.system('touch {marker}')\n{body}\n")
    return folder


def test_string_constants_are_folded_not_executed(tmp_path):
    marker = tmp_path / "ran"
    source = f"open({str(marker)!r}, 'w')\nA = 'ab' 'cd'\nB = 'x' + 'y' + 'z'\nC = f'no{{A}}'\n"
    assert {"abcd", "xyz"} <= string_constants(source)
    assert not marker.exists()


def test_first_release_encoder_is_v4(tmp_path):
    marker = tmp_path / "ran"
    body = f"REASONING_EFFORT_MAX = {_chunks(ABSOLUTE)}\n"
    found = from_encoding_folder(_encoder(tmp_path / "flash", body, marker))
    assert found is not None and found.edition == "v4" and "encoding_dsv4.py" in found.reason
    assert not marker.exists()


def test_later_encoder_is_v4_vision(tmp_path):
    marker = tmp_path / "ran"
    body = f'PROMPTS = {{"low": "", "high": {_chunks(ABSOLUTE)}, "max": {_chunks(BEYOND[:50])} + {BEYOND[50:]!r}}}\n'
    found = from_encoding_folder(_encoder(tmp_path / "0731", body, marker))
    assert found is not None and found.edition == "v4-vision"
    assert not marker.exists()


def test_unknown_or_unreadable_encoder_falls_through(tmp_path, caplog):
    odd = _encoder(tmp_path / "odd", "P = 'Reasoning Effort: Medium-ish.'\n", tmp_path / "ran")
    with caplog.at_level(logging.WARNING, logger="ds4serve.chat.edition"):
        assert from_encoding_folder(odd) is None
    assert "match no known edition" in caplog.text
    broken = tmp_path / "broken"
    (broken / "encoding").mkdir(parents=True)
    (broken / "encoding" / "enc.py").write_text("def (:\n")
    (broken / "config.json").write_text('{"_name_or_path": "deepseek-ai/DeepSeek-V4-Flash"}')
    choice = choose_edition(broken)
    assert choice.edition == "v4" and "config.json" in choice.reason
    assert from_encoding_folder(tmp_path / "none") is None


@pytest.mark.parametrize("config, edition", [
    ({"vision_n_layers": 2}, "v4-vision"),
    ({"model_type": "deepseek_v4_vl"}, "v4-vision"),
    ({"_name_or_path": "deepseek-ai/DeepSeek-V4-Flash-0731"}, "v4-vision"),
    ({"_name_or_path": "deepseek-ai/DeepSeek-V4-Flash"}, "v4"),
    ({"model_type": "deepseek_v4", "vision_n_layers": "x"}, None),
    ({}, None),
])
def test_what_the_config_says(config, edition):
    found = from_config(config)
    assert (found.edition if found else None) == edition


def test_override_and_default(tmp_path):
    flash = _encoder(tmp_path / "flash", f"M = {ABSOLUTE!r}\n", tmp_path / "ran")
    assert choose_edition(flash, "v4-vision").reason == "set by --chat-encoding"
    with pytest.raises(EditionError, match="v4-vision"):
        choose_edition(flash, "v5")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text('{"model_type": "deepseek_v4"}')
    choice = choose_edition(plain)
    assert choice.edition == DEFAULT_EFFORT_EDITION and "default" in choice.reason


def _rendered(srv, effort: str) -> str:
    r = httpx.post(srv.base + "/apply-template", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"thinking": True, "reasoning_effort": effort}})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_server_renders_the_checkpoints_edition_and_logs_why(random_ckpt, tmp_path, caplog):
    ckpt = tmp_path / "DeepSeek-V4-Flash-like"
    ckpt.mkdir()
    for f in Path(random_ckpt).iterdir():
        (ckpt / f.name).symlink_to(f)
    _encoder(ckpt, f"REASONING_EFFORT_MAX = {_chunks(ABSOLUTE)}\n", tmp_path / "ran")
    bos_user = "<｜begin▁of▁sentence｜><｜User｜>"
    with caplog.at_level(logging.INFO, logger="ds4serve.server.launch"), serve(ckpt) as srv:
        assert _rendered(srv, "high").startswith(bos_user)  # the first release: high adds nothing
        assert _rendered(srv, "max").startswith("<｜begin▁of▁sentence｜>" + ABSOLUTE + "<｜User｜>")
    assert "edition 'v4'" in caplog.text and "encoding_dsv4.py" in caplog.text
    with serve(ckpt, chat_encoding="v4-vision") as srv:
        assert _rendered(srv, "high").startswith("<｜begin▁of▁sentence｜>" + ABSOLUTE)
        assert _rendered(srv, "max").startswith("<｜begin▁of▁sentence｜>" + BEYOND)
    assert not (tmp_path / "ran").exists()
