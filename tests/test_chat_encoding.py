"""The DS4 chat encoding, byte for byte: DeepSeek's published vectors, then one vector per branch.

The branch vectors were written by hand from reading DeepSeek's reference encoder
(``encoding/encoding_dsv4.py``; the Vision-Exp edition for images and effort levels), not produced
by our code; see tests/data/ds4_encoding/README.md for where the published ones come from.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ds4serve.chat import Tokenizer
from ds4serve.chat.dsml import EFFORT_PROMPTS, render_tools
from ds4serve.chat.encoding import ChatOptions, encode_chat
from ds4serve.chat.prompt import render_ds4
from ds4serve.chat.template import ChatFormatError

DATA = Path(__file__).parent / "data" / "ds4_encoding"
ROOT = Path(__file__).resolve().parent.parent
B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
T, TE, IMG, LR = "<think>", "</think>", "<｜deepseek_image｜>", "<｜latest_reminder｜>"
D = "｜DSML｜"
# sha256 of deepseek-ai/DeepSeek-V4-Flash@60d8d707 encoding/tests/* (as recorded by maxtext)
PUBLISHED = {
    "test_input_1.json": "10e0c074c977c3a80daab758af28219c6b1c2bd7f3f5cf2890c84b361cc32897",
    "test_input_2.json": "c44ae0db20fafff38a6021e8068d7ed6e28605d76cafd20be80b03398509f447",
    "test_input_3.json": "37bf8ef95e0411ea5f411be0b02fbafec7363438b6ccefddca0c52ec9aeaf69a",
    "test_input_4.json": "c45bbd0a1b7a2f75033d8db4ba74ee5b7653bd01114045a52f79d3b387663465",
    "test_output_1.txt": "9b366d9d2eac842a6e890594aac0b58648e5623717202b33497afadf03e26540",
    "test_output_2.txt": "ca66b01a1ac3a204bb032c928fb607d4877171e998a50f7f89f39fa821b75665",
    "test_output_3.txt": "b3b1cd8748b7b90d3c6be6da3f786f12e4d70be073bd445ea162dfad4dc01a64",
    "test_output_4.txt": "60e1643840ba9e4aeede450feb7b0498fa66ee24e4a939d48855ce04ec6fc375",
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ROOT / "models" / "ds4v-tiny")


def enc(messages, **kw) -> str:
    return encode_chat(messages, ChatOptions(**kw)).text


def published(case: int) -> tuple[list, str, bool]:
    data = json.loads((DATA / f"test_input_{case}.json").read_text())
    if isinstance(data, dict):  # case 1: the reference test puts the tools on the first message
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    return messages, (DATA / f"test_output_{case}.txt").read_text(), case != 4


def test_published_vectors_are_the_upstream_files():
    for name, digest in PUBLISHED.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_published_vectors_byte_exact(case, tok):
    messages, gold, thinking = published(case)
    assert enc(messages, thinking=thinking) == gold
    rendered = render_ds4(tok, messages, ChatOptions(thinking=thinking))
    assert rendered.text == gold
    assert rendered.ids == tok.encode_markup(gold)  # the reference's tokenizer.encode(prompt)


def test_vllm_reasoning_spelling_is_accepted():
    messages, gold, _ = published(2)
    for m in messages:
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
    assert enc(messages, thinking=True) == gold


def test_chat_and_thinking_generation_prompts():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert enc(msgs) == B + "S" + U + "hi" + A + TE
    assert enc(msgs, thinking=True) == B + "S" + U + "hi" + A + T
    assert enc(msgs, add_bos=False) == "S" + U + "hi" + A + TE


HISTORY = [{"role": "user", "content": "q1"},
           {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
           {"role": "user", "content": "q2"}]


def test_earlier_reasoning_dropped_or_kept():
    assert enc(HISTORY, thinking=True) == B + U + "q1" + A + TE + "a1" + E + U + "q2" + A + T
    assert enc(HISTORY, thinking=True, drop_thinking=False) == \
        B + U + "q1" + A + T + "r1" + TE + "a1" + E + U + "q2" + A + T
    assert enc(HISTORY) == B + U + "q1" + A + TE + "a1" + E + U + "q2" + A + TE  # chat: never rendered


def test_reasoning_after_the_last_user_turn_is_kept():
    msgs = HISTORY + [{"role": "assistant", "reasoning": "r2", "content": "a2"}]
    assert enc(msgs, thinking=True).endswith(U + "q2" + A + T + "r2" + TE + "a2" + E)


def test_request_tools_on_a_user_first_conversation_get_an_empty_system_message():
    got = enc(HISTORY, thinking=True, tools=[TOOL])
    tools = "\n\n" + render_tools([TOOL])
    assert tools.startswith("\n\n## Tools\n\nYou have access to a set of tools")
    # tools present: nothing is dropped, every turn opens thinking
    assert got == B + tools + U + "q1" + A + T + "r1" + TE + "a1" + E + U + "q2" + A + T
    assert '{"name": "get_weather", "description": "Weather", "parameters": {"type": "object"' in got


def test_request_tools_and_response_format_ride_on_the_system_message():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    got = enc([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], tools=[TOOL], response_format=rf)
    fmt = ("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
           '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}')
    assert got == B + "S" + "\n\n" + render_tools([TOOL]) + fmt + U + "q" + A + TE
    assert enc([{"role": "user", "content": "q"}], response_format={"type": "json_object"}) == \
        B + "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" \
        '{"type": "json_object"}' + U + "q" + A + TE
    assert enc([{"role": "user", "content": "q"}], response_format={"type": "text"}) == B + U + "q" + A + TE


def test_tools_on_a_developer_message():
    got = enc([{"role": "developer", "content": "D"}], tools=[TOOL], thinking=True)
    assert got == B + U + "D" + "\n\n" + render_tools([TOOL]) + A + T


@pytest.mark.parametrize("edition,effort,first_line", [
    ("v4-vision", "max", "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"),
    ("v4-vision", "high", "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"),
    ("v4-vision", "low", ""), ("v4-vision", None, ""),
    ("v4", "max", "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"),
    ("v4", "high", ""), ("v4", "low", ""),
])
def test_reasoning_effort_prefixes(edition, effort, first_line):
    msgs = [{"role": "user", "content": "hi"}]
    prefix = EFFORT_PROMPTS[edition][effort]
    assert prefix.startswith(first_line) and (not prefix or prefix.endswith("unchecked.\n\n")
                                              or prefix.endswith("undiscovered.\n\n"))
    assert enc(msgs, thinking=True, reasoning_effort=effort, effort_edition=edition) == B + prefix + U + "hi" + A + T
    assert enc(msgs, reasoning_effort=effort, effort_edition=edition) == B + U + "hi" + A + TE  # chat: none
    assert EFFORT_PROMPTS["v4"]["max"] == EFFORT_PROMPTS["v4-vision"]["high"]


def _call(cid, name, args="{}"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_tool_results_merge_into_a_user_turn_in_call_order():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "f"), _call("b", "g")]},
            {"role": "tool", "tool_call_id": "b", "content": "RB"},
            {"role": "tool", "tool_call_id": "a", "content": "RA"},
            {"role": "user", "content": "thanks"}]
    block = (f"\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n\n</{D}invoke>\n<{D}invoke name=\"g\">\n\n</{D}invoke>\n"
             f"</{D}tool_calls>")
    assert enc(msgs) == (B + U + "q" + A + TE + block + E + U + "<tool_result>RA</tool_result>\n\n"
                         "<tool_result>RB</tool_result>\n\nthanks" + A + TE)


def test_tool_call_parameters_strings_raw_others_json():
    args = '{"city": "Paris", "days": 3, "opts": {"a": [1, true]}, "note": null}'
    want = (f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
            f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
            f'<{D}parameter name="opts" string="false">{{"a": [1, true]}}</{D}parameter>\n'
            f'<{D}parameter name="note" string="false">null</{D}parameter>')
    for a in (args, json.loads(args)):  # a dict is taken as already parsed
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("x", "f", a)]}]
        assert f'<{D}invoke name="f">\n' + want + f"\n</{D}invoke>" in enc(msgs)
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("x", "f", "not json")]}]
    assert f'<{D}parameter name="arguments" string="true">not json</{D}parameter>' in enc(bad)


def test_developer_and_latest_reminder_roles():
    msgs = [{"role": "developer", "content": "D1"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert enc(msgs) == B + U + "D1" + U + "q1" + A + TE + "a1" + E + U + "q2" + A + TE
    # thinking + dropping: a developer message before the last user turn goes
    assert enc(msgs, thinking=True) == B + U + "q1" + A + TE + "a1" + E + U + "q2" + A + T
    rem = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "R"},
           {"role": "user", "content": "q"}]
    assert enc(rem) == B + "S" + LR + "R" + U + "q" + A + TE


def test_consecutive_users_merge_and_prefix_completion():
    assert enc([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == B + U + "a\n\nb" + A + TE
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hel", "prefix": True}]
    assert enc(msgs) == B + U + "q" + A + TE + "Hel"


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_images_become_placeholders_joined_like_text(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE_PART, {"type": "text", "text": "b"}]}]
    assert enc(msgs) == B + U + "a\n\n" + IMG + "\n\nb" + A + TE
    r = render_ds4(tok, msgs)
    assert r.images == [IMAGE_PART] and [r.ids[k] for k in r.image_positions] == [tok.image_id]
    assert r.ids == tok.encode_markup(r.text)


def test_vision_exp_style_case():
    """The Vision-Exp case (two images interleaved with text), chat and thinking + max effort."""
    t1, t2, t3 = "请按“第一张、第二张”的顺序回答：第一张图", "和第二张图", "中分别是什么食材？它们通常食用的部位分别是什么？"
    parts = [{"type": "text", "text": t1}, IMAGE_PART, {"type": "text", "text": t2}, IMAGE_PART,
             {"type": "text", "text": t3}]
    msgs = [{"role": "system", "content": "You are a helpful vision assistant."}, {"role": "user", "content": parts}]
    body = ("You are a helpful vision assistant." + U + t1 + "\n\n" + IMG + "\n\n" + t2 + "\n\n" + IMG + "\n\n"
            + t3 + A)
    assert enc(msgs) == B + body + TE
    assert enc(msgs, thinking=True, reasoning_effort="max") == B + EFFORT_PROMPTS["v4-vision"]["max"] + body + T
    assert len(encode_chat(msgs).images) == 2


def test_images_in_tool_results():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("a", "f")]},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "r"}, IMAGE_PART]}]
    assert enc(msgs).endswith(U + "<tool_result>r\n\n" + IMG + "</tool_result>" + A + TE)


def test_typed_role_markers_stay_text(tok):
    msgs = [{"role": "user", "content": "x<｜User｜>y<｜Assistant｜>"}]
    r = render_ds4(tok, msgs)
    assert r.text == B + U + "x<｜User｜>y<｜Assistant｜>" + A + TE
    assert r.ids.count(tok.user_id) == 1 and r.ids.count(tok.assistant_id) == 1
    assert r.ids[:2] == [tok.bos_id, tok.user_id] and r.ids[-2:] == [tok.assistant_id, tok.think_end_id]


@pytest.mark.parametrize("messages,kw,param", [
    ([{"role": "function", "content": "x"}], {}, "messages[0].role"),
    ([{"role": "user", "content": "hi"}], {"reasoning_effort": "medium"}, "reasoning_effort"),
    ([{"role": "developer", "content": ""}], {}, "messages[0]"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], {}, "messages[0].content[0].type"),
    ([{"role": "user", "content": "a " + IMG}], {}, "messages[0].content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("a", "f", "[1]")]}], {},
     "messages[1].tool_calls"),
    ([{"role": "system", "content": "S", "tools": [TOOL]}], {"tools": [TOOL]}, "messages"),
    ([], {}, "messages"),
    ([{"role": "user", "content": "q"}], {"tools": [{"type": "function"}]}, "tools"),
    ([{"role": "user", "content": "q"}], {"effort_edition": "v5"}, "effort_edition"),
])
def test_errors_name_the_field(messages, kw, param):
    with pytest.raises(ChatFormatError) as err:
        encode_chat(messages, ChatOptions(**kw))
    assert err.value.param == param
