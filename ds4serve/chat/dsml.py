"""DS4's prompt vocabulary: special strings, the ``｜DSML｜`` tool-call markup and fixed prompt texts.

These strings are the contract with the checkpoint (DeepSeek's ``encoding/encoding_dsv4.py``): the
model was trained on exactly these bytes, so they live in one place and are never reformatted. The
encoder (``encoding.py``) renders with them and the output parser (``output_parser.py``) reads the
same markup back.

Reasoning-effort prefixes come in two published editions, because DeepSeek changed them:

* ``"v4"``: DeepSeek-V4-Flash at its first release (revision 60d8d707): only ``"max"`` adds a
  prefix, the "Absolute maximum" text; ``"high"`` and no effort add nothing (that encoder rejects
  ``"low"``; here it adds nothing too, so the API takes the same three values in both editions).
* ``"v4-vision"`` (default): the DeepSeek-V4-Flash-Vision-Exp encoder (and DeepSeek's later
  three-level semantics, also adopted by vLLM): ``"low"`` adds nothing, ``"high"`` adds the
  "Absolute maximum" text, ``"max"`` the "Beyond maximum" text.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK = "<think>"
THINK_END = "</think>"
IMAGE = "<｜deepseek_image｜>"
DSML = "｜DSML｜"
TASK_TOKENS = {
    "action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
    "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>",
}
#: Strings rendered as one special token where the vocabulary has them (text otherwise).
SPECIAL_STRINGS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK, THINK_END, IMAGE,
                   *TASK_TOKENS.values())

TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"

_HIGH = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
         "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
         "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
         "adversarial scenarios.\n"
         "Explicitly write out your entire deliberation process, documenting every intermediate step, "
         "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
         "unchecked.\n\n")
_MAX = ("Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
        "resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
        "certain that no assumption remains unchecked and no error remains undiscovered.\n\n")
#: edition -> {effort: prefix}; ``None`` effort means the edition's default (no prefix in both).
EFFORT_PROMPTS: dict[str, dict[str | None, str]] = {
    "v4": {None: "", "low": "", "high": "", "max": _HIGH},
    "v4-vision": {None: "", "low": "", "high": _HIGH, "max": _MAX},
}
DEFAULT_EFFORT_EDITION = "v4-vision"

RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside {think}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class MarkupError(ValueError):
    """A tool or tool call cannot be rendered (the message names the field)."""


def to_json(value: Any) -> str:
    """JSON exactly as the reference writes it into prompts: ``", "`` / ``": "`` separators, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools_parts(tools: list[dict[str, Any]]) -> tuple[str, str, str]:
    """The ``## Tools`` block as (template head, the client's schemas, template tail).

    Each tool's whole ``function`` object is written, key order kept, because that is what the
    model saw. The parts are apart because only the schemas are client text (tokenized as such).
    """
    schemas = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MarkupError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        schemas.append(to_json(fn))
    head, tail = TOOLS_TEMPLATE.split("{schemas}")
    fill = {"dsml": DSML, "think": THINK, "think_end": THINK_END}
    return head.format(**fill), "\n".join(schemas), tail.format(**fill)


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The ``## Tools`` block for OpenAI-format ``tools`` (each ``{"type": "function", "function": {...}}``)."""
    return "".join(render_tools_parts(tools))


def render_response_format(response_format: dict[str, Any]) -> tuple[str, str]:
    """The ``## Response Format`` block as (template, the whole ``response_format`` as JSON), as the
    reference writes it."""
    return RESPONSE_FORMAT_TEMPLATE.replace("{schema}", ""), to_json(response_format)


def _call_arguments(call: dict[str, Any], where: str) -> dict[str, Any]:
    """Parsed ``function.arguments`` of one OpenAI tool call.

    As the reference: a JSON string is parsed and text that is not JSON becomes one ``arguments``
    string parameter. Beyond it (the reference fails or nests there): a dict is taken as already
    parsed, and ``None`` / ``""`` mean no arguments.
    """
    raw = call.get("function", {}).get("arguments")
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise MarkupError(f"{where}.function.arguments must be a JSON string")
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {"arguments": raw}
    if not isinstance(parsed, dict):
        raise MarkupError(f"{where}.function.arguments must encode a JSON object")
    return parsed


def render_tool_calls(tool_calls: list[dict[str, Any]], where: str) -> str:
    """Assistant ``tool_calls`` as the ``<｜DSML｜tool_calls>`` block, with its leading blank line.

    Strings are written raw with ``string="true"``; every other value as JSON with ``string="false"``.
    """
    invokes = []
    for i, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MarkupError(f"{where}[{i}] must be {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
        params = []
        for key, value in _call_arguments(call, f"{where}[{i}]").items():
            is_str = isinstance(value, str)
            params.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                          f'{value if is_str else to_json(value)}</{DSML}parameter>')
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return "\n\n" + TOOL_CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + TOOL_CALLS_CLOSE
