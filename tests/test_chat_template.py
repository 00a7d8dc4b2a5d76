"""The bundled model folder's ``chat_template.jinja`` renders the DS4 encoding for
``AutoTokenizer.apply_chat_template`` (lm-eval's ``--apply_chat_template``, vLLM, plain transformers):
equal to ds4serve's own renderer on DeepSeek's published vectors and on conversations built to reach
each rule (merging, ordering, dropping, tasks, images), and an error where it cannot be exact."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ds4serve.chat.encoding import ChatOptions, encode_chat

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "ds4v-tiny"
DATA = Path(__file__).resolve().parent / "data" / "ds4_encoding"
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(BUNDLED))


def _object_arguments(messages: list[dict]) -> list[dict]:
    """Tool-call arguments as objects, the form transformers and vLLM hand a template (ds4serve takes both)."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call["function"].get("arguments"), str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


def _both(hf, messages: list[dict], tools: list | None = None, **kw) -> tuple[str, str]:
    options = {("thinking" if k == "enable_thinking" else k): v for k, v in kw.items()}
    ours = encode_chat(copy.deepcopy(messages), ChatOptions(tools=tools, **options)).text
    theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
    return ours, theirs


@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_published_vectors(hf, case):
    data = json.loads((DATA / f"test_input_{case}.json").read_text())
    messages = data if isinstance(data, list) else [{**data["messages"][0], "tools": data["tools"]}] + data["messages"][1:]
    gold = (DATA / f"test_output_{case}.txt").read_text()
    thinking = case != 4  # the reference test's modes: 1-3 thinking, 4 chat
    assert hf.apply_chat_template(_object_arguments(messages), tokenize=False, add_generation_prompt=True,
                                  thinking=thinking) == gold


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And <｜User｜> you?"}]
CALLS = [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "", "reasoning_content": "two cities",
          "tool_calls": [{"id": "a", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
                         {"id": "b", "type": "function",
                          "function": {"name": "weather", "arguments": {"city": "Rome", "days": 2, "x": [1, None]}}}]},
         {"role": "tool", "tool_call_id": "b", "content": "sun"}, {"role": "tool", "tool_call_id": "a", "content": "rain"},
         {"role": "user", "content": "thanks"}]
CASES = {
    "chat multi-turn": (CHAT, None, {}),
    "thinking multi-turn, earlier reasoning dropped": (
        CHAT[:2] + [{**CHAT[2], "reasoning_content": "greet"}] + CHAT[3:], None, {"thinking": True}),
    "enable_thinking spelling": (CHAT, None, {"enable_thinking": True}),
    "thinking, reasoning kept": (
        CHAT[:2] + [{**CHAT[2], "reasoning_content": "greet"}] + CHAT[3:], None, {"thinking": True, "drop_thinking": False}),
    "request tools on a user-first chat": ([{"role": "user", "content": "Oslo?"}], [WEATHER], {}),
    "tool results reordered and merged": (CALLS, [WEATHER], {"thinking": True}),
    "tool loop in chat mode": (CALLS, [WEATHER], {}),
    "consecutive users and text parts": ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]},
                                          {"role": "user", "content": "c"}], None, {}),
    "images": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                             {"type": "text", "text": "what is it?"}]}], None, {}),
    "developer and latest_reminder": ([{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "R"},
                                       {"role": "developer", "content": "D"}, {"role": "assistant", "content": "x"},
                                       {"role": "user", "content": "U"}], None, {"thinking": True}),
    "task tokens": ([{"role": "user", "content": "q", "task": "query"}, {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "go", "task": "action"}], None, {"thinking": True}),
    "prefix completion": ([{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "H", "prefix": True}],
                          None, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_equal_to_ds4serve(hf, name):
    messages, tools, kw = CASES[name]
    ours, theirs = _both(hf, messages, tools, **kw)
    assert theirs == ours


def test_no_generation_prompt_leaves_the_assistant_marker_off(hf):
    ours = encode_chat(copy.deepcopy(CHAT)).text
    assert ours.endswith("<｜Assistant｜></think>")
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False) == ours[:-len("<｜Assistant｜></think>")]


@pytest.mark.parametrize("messages, kw, match", [
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
      "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"a": 1}'}}]}], {}, "JSON string"),
    (CHAT, {"thinking": True, "reasoning_effort": "max"}, "effort"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    ([{"role": "user", "content": "x", "task": "nap"}], {}, "task"),
    ([{"role": "wizard", "content": "x"}], {}, "role"),
])
def test_what_it_cannot_render_exactly_is_an_error(hf, messages, kw, match):
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match=match):
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def test_only_the_template_was_added_to_the_model_folder():
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    assert "chat_template" not in config  # transformers finds chat_template.jinja by its name
    assert (BUNDLED / "chat_template.jinja").stat().st_size < 20_000
