"""Which grammar a chat request's output must follow: ``response_format`` and ``tool_choice`` -> a spec.

``grammar_spec`` reads the OpenAI request fields and returns a ``GrammarSpec`` (the llguidance Lark
text, a cache key, and the request field each part came from), or ``None`` when the output is free.
The spec is pure data, so it is built and checked on the request path before anything is queued;
``grammar_runtime.GrammarCompiler`` compiles it (cached by ``key``) and makes per-request matchers.

What each field asks for (the grammar applies to the answer: after ``</think>`` in thinking mode):

* ``response_format`` ``{"type": "json_object"}``: one JSON object; ``{"type": "json_schema",
  "json_schema": {"schema": ...}}``: one JSON value valid for the schema (``strict`` or not: an
  answer that does not validate is never useful), objects listing ``properties`` without
  ``additionalProperties`` generated closed (``schema_closed``); ``{"type": "text"}``: nothing.
* ``tool_choice`` ``"required"``: one or more well-formed DSML calls of the declared tools, nothing
  else; a named function (``{"type": "function", "function": {"name": ...}}``): exactly one call of
  it. Arguments validate against the tool's ``parameters`` schema (see ``grammar_lark``).
* ``"auto"`` (the default when ``tools`` are given): free text (or the ``response_format`` JSON),
  and once the model opens ``<｜DSML｜tool_calls>`` the rest is a well-formed block.
* ``"none"``: free text (or the JSON) that never opens or closes DSML markup.
* ``parallel_tool_calls: false``: the block of ``"required"`` and ``"auto"`` closes after its first
  call, so a second call cannot be sampled (the grammar, not a post-hoc cut, as vLLM's structural
  tags do); a named function is one call either way.

Errors are ``GrammarError`` with ``field`` naming the request field (a 400 for the server).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from . import grammar_lark as gl

TOOL_CHOICES = ("auto", "none", "required")


class GrammarError(ValueError):
    """A grammar cannot be built from the request; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class GrammarSpec:
    """One output grammar. ``lark`` is llguidance's source, ``key`` its cache key; ``fields`` maps the
    request fields that went into it to the JSON schemas they carried (to name the field when the
    library rejects one); ``mode`` is ``json`` | ``none`` | ``auto`` | ``required`` | ``named``."""
    mode: str
    lark: str
    key: str
    fields: tuple[tuple[str, Any], ...] = ()


def _spec(mode: str, lark: str, fields: list[tuple[str, Any]]) -> GrammarSpec:
    return GrammarSpec(mode, lark, hashlib.sha256(lark.encode()).hexdigest(), tuple(fields))


def answer_schema(response_format: Any) -> tuple[dict[str, Any] | None, list[tuple[str, Any]]]:
    """The JSON schema ``response_format`` asks for (``None``: free text) and its field."""
    if response_format is None:
        return None, []
    if not isinstance(response_format, dict):
        raise GrammarError("response_format", "must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None, []
    if kind == "json_object":
        return {"type": "object"}, [("response_format", {"type": "object"})]
    if kind != "json_schema":
        raise GrammarError("response_format.type", f"must be text, json_object or json_schema, not {kind!r}")
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, dict):
        raise GrammarError("response_format.json_schema", "must be an object with a schema")
    schema = wrapper.get("schema", {})
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema", "must be a JSON Schema object")
    return schema, [("response_format.json_schema.schema", schema)]


def _tool_params(tools: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(name, parameters schema)`` per tool, checked enough to write its markup."""
    if not isinstance(tools, list) or not tools:
        raise GrammarError("tools", "must be a non-empty list")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not gl.check_name(fn["name"]):
            raise GrammarError(f"tools[{i}].function.name", "must be a name without quotes, < or >")
        if fn["name"] in seen:
            raise GrammarError(f"tools[{i}].function.name", f"duplicate tool name {fn['name']!r}")
        seen.add(fn["name"])
        out.append((fn["name"], _check_params(fn.get("parameters"), f"tools[{i}].function.parameters")))
    return out


def _check_params(params: Any, field: str) -> dict[str, Any]:
    """A tool's ``parameters``: an object schema (absent: no arguments)."""
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise GrammarError(field, 'must be a JSON Schema with "type": "object"')
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise GrammarError(f"{field}.properties", "must map names to schemas")
    bad = [k for k in props if not gl.check_name(k)]
    if bad:
        raise GrammarError(f"{field}.properties", f"names cannot hold quotes, < or >: {bad}")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise GrammarError(f"{field}.required", "must list names declared in properties")
    return params


def _chosen(tool_choice: Any, tools: list[tuple[str, dict[str, Any]]]) -> tuple[str, list]:
    """The ``tool_choice`` mode and the tools it allows."""
    if tool_choice is None:
        return "auto", tools
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise GrammarError("tool_choice", f"must be one of {TOOL_CHOICES} or a named function")
        return tool_choice, tools
    if not isinstance(tool_choice, dict):
        raise GrammarError("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")  # also the Responses API shape
    if not isinstance(name, str):
        raise GrammarError("tool_choice", 'must be a string or {"type": "function", "function": {"name": ...}}')
    match = [t for t in tools if t[0] == name]
    if not match:
        raise GrammarError("tool_choice.function.name", f"names no tool in tools: {name!r}")
    return "named", match


def grammar_spec(*, response_format: Any = None, tools: Any = None, tool_choice: Any = None,
                 parallel_tool_calls: bool = True) -> GrammarSpec | None:
    """The grammar these request fields ask for, or ``None`` for free output (see the module doc)."""
    schema, fields = answer_schema(response_format)
    if not tools:
        if tool_choice in ("required",) or isinstance(tool_choice, dict):
            raise GrammarError("tool_choice", "needs tools")
        if tool_choice == "none":
            return _spec("json", gl.json_answer(schema), fields) if schema is not None else \
                _spec("none", gl.text_no_markup(), [])
        if tool_choice not in (None, "auto"):
            _chosen(tool_choice, [])  # raises the precise error
        return _spec("json", gl.json_answer(schema), fields) if schema is not None else None
    declared = _tool_params(tools)
    mode, allowed = _chosen(tool_choice, declared)
    tool_fields = [(f"tools[{i}].function.parameters", p) for i, (_, p) in enumerate(declared)]
    if mode == "none":
        return _spec("json", gl.json_answer(schema), fields) if schema is not None else \
            _spec("none", gl.text_no_markup(), [])
    if mode in ("required", "named"):
        return _spec(mode, gl.forced_calls(allowed, many=mode == "required" and parallel_tool_calls), tool_fields)
    return _spec("auto", gl.auto_calls(allowed, schema, many=parallel_tool_calls), fields + tool_fields)
