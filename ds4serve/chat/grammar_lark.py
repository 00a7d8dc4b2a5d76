"""llguidance Lark grammars for DS4 answers: JSON, free text without markup, and ``｜DSML｜`` tool calls.

The tool-call grammar spells exactly what ``dsml.render_tool_calls`` renders (and so what
``dsml_stream.DsmlScanner`` reads back)::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Parameters come in the schema's ``properties`` order, required ones always, optional ones maybe; a
tool whose ``parameters`` declare no properties (and do not forbid extra ones) takes any names.
Plain ``"type": "string"`` properties are raw text (``string="true"``), with ``enum``/``const``,
``minLength``/``maxLength`` and ``pattern`` enforced on the raw text; every other property (and a
string with ``format``, which only the JSON compiler checks) is JSON with ``string="false"``, checked
by llguidance's JSON-schema compiler, from ``schema_closed.closed(schema)``: an object listing its
properties without ``additionalProperties`` gets no unlisted keys (the declared parameters above are
closed the same way). JSON is written compactly with ``", "``/``": "`` separators,
as ``dsml.to_json`` writes history, so the model sees its own training format.

Lexing note: llguidance's lexer decides a lexeme with one byte of lookahead, so "text up to a
closing tag" is one lexeme that *includes* the tag (``TEXT_OPEN``, ``*_END``), never text followed
by a separate tag lexeme.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from .dsml import DSML, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN
from .schema_closed import closed

#: JSON layout inside grammars: no free whitespace, the separators ``dsml.to_json`` writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PARAM_CLOSE = f"</{DSML}parameter>"
INVOKE_CLOSE = f"</{DSML}invoke>"


def _avoiding(lead: str) -> str:
    """A regex of the texts that never contain ``"<" + lead + "｜DSML｜"`` for any of ``lead``
    (``"/"``: no closer; ``"/?"``: neither opener nor closer), written out as the pattern's
    automaton instead of with ``~``/``&``: with ``grammar_runtime.SLICES`` llguidance then decides
    plain-text states without walking the whole vocabulary (measured at 129k tokens: 0.1-0.3 ms a
    row instead of 3-5 ms). States inside a possible tag (after ``<``) still walk it."""
    tail = "([^D<]|D([^S<]|S([^M<]|M([^L<]|L[^｜<]))))"  # after "<｜" / "</｜": must not spell DSML｜
    partial_tail = "(D(S(M(L)?)?)?)?"
    if lead == "/":  # after "<": "/" then the tail
        after_lt, partial = f"([^\\/<]|\\/([^｜<]|｜{tail}))", f"(\\/(｜{partial_tail})?)?"
    else:
        after_lt = f"([^\\/｜<]|\\/([^｜<]|｜{tail})|｜{tail})"
        partial = f"(\\/|(\\/)?｜{partial_tail})?"
    return f"/(?s:([^<]|<({partial}<)*{after_lt})*(<({partial}<)*{partial})?)/"


# text holding neither an opener "<｜DSML｜" nor a closer "</｜DSML｜": what the scanner keeps as text
_NOMARK = _avoiding("/?")
_NOCLOSE = _avoiding("/")
_STRING_RAW_KEYS = {"type", "enum", "const", "minLength", "maxLength", "pattern", "description", "title",
                    "default", "examples"}


def lit(text: str) -> str:
    """A Lark string literal for ``text`` (JSON escapes, non-ASCII kept)."""
    return json.dumps(text, ensure_ascii=False)


def json_item(schema: Any, defs: dict[str, Any] | None = None) -> str:
    """``%json{...}`` for ``schema``, with the root's ``$defs`` so local ``$ref`` still resolve, and its
    objects that list properties closed (``schema_closed``: no unlisted keys unless the schema says so)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    sub = dict(schema)
    for key, value in (defs or {}).items():
        sub.setdefault(key, value)
    sub = closed(sub)
    sub["x-guidance"] = {**JSON_OPTIONS, **sub.get("x-guidance", {})}
    return "%json" + json.dumps(sub, ensure_ascii=False)


def header(extra_rules: list[str], start: str) -> str:
    """A whole grammar: the start rule, shared lexemes, then ``extra_rules``."""
    return "\n".join(["%llguidance {}", f"start: {start}", f"NOMARK: {_NOMARK}",
                      f"TEXT_OPEN: NOMARK {lit(TOOL_CALLS_OPEN)}", *extra_rules]) + "\n"


def text_no_markup() -> str:
    """``tool_choice: "none"``: any text without a DSML opener or closer."""
    return header([], "NOMARK")


def json_answer(schema: dict[str, Any]) -> str:
    """``response_format``: one JSON value for ``schema`` (``{"type": "object"}`` for json_object)."""
    return header([], json_item(schema))


def _is_raw_string(schema: Any) -> bool:
    """Whether a property is written raw (``string="true"``), as the encoder writes strings."""
    if not isinstance(schema, dict) or not set(schema) <= _STRING_RAW_KEYS:
        return False
    if "pattern" in schema and _anchored_body(schema["pattern"]) is None:
        return False  # left to the JSON compiler, which knows ECMA patterns fully
    if schema.get("type") == "string":
        return True
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    return "type" not in schema and bool(values) and all(isinstance(v, str) for v in values)


def _anchored_body(pattern: Any) -> str | None:
    """The body of a ``^...$`` pattern without top-level alternation (the usual kind), else None."""
    if not isinstance(pattern, str) or not pattern.startswith("^") or not pattern.endswith("$") \
            or pattern.endswith("\\$") or "|" in pattern:
        return None
    return pattern[1:-1]


def _pattern_regex(pattern: str) -> str:
    """A ``^...$`` JSON-schema pattern (ECMA: ``\\d`` is ASCII) as a full-match Lark regex."""
    return "/(?:" + llguidance.regex_to_lark(_anchored_body(pattern), "dw") + ")/"


def _raw_value(schema: dict[str, Any]) -> str:
    """The lexeme of a raw string value, its closing tag included."""
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if values is not None:
        body = "(" + " | ".join(lit(v) for v in values if PARAM_CLOSE not in v) + ")"
    else:
        body = _NOCLOSE
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if lo is not None or hi is not None:
            body += f" & /(?s:.{{{int(lo or 0)},{'' if hi is None else int(hi)}}})/"
        if "pattern" in schema:
            body += " & " + _pattern_regex(schema["pattern"])
        body = f"({body})"
    return f"{body} {lit(PARAM_CLOSE)}"


def _opener(key: str, string: bool) -> str:
    """The literal ``<｜DSML｜parameter name="key" string="true|false">``."""
    return lit(f'<{DSML}parameter name="{key}" string="{"true" if string else "false"}">')


def _param(rules: list[str], name: str, key: str, schema: Any, defs: dict[str, Any]) -> None:
    """Rule ``name``: one ``<｜DSML｜parameter>`` for property ``key``."""
    if _is_raw_string(schema):
        rules.append(f"{name.upper()}_END: {_raw_value(schema)}")
        rules.append(f"{name}: {_opener(key, True)} {name.upper()}_END")
    else:
        rules.append(f"{name}: {_opener(key, False)} {json_item(schema, defs)} {lit(PARAM_CLOSE)}")


def _generic_params(rules: list[str], name: str) -> None:
    """Any parameters, any names: for tools whose schema declares no properties."""
    key, raw = f"{name}_key", f"{name.upper()}_RAW_END"
    open_, as_raw, as_json = f'<{DSML}parameter name="', '" string="true">', '" string="false">'
    rules += [f"{key}: {lit(open_)} /[A-Za-z_][A-Za-z0-9_.-]*/",
              f"{name}_one: {key} {lit(as_raw)} {raw} | {key} {lit(as_json)} {json_item({})} {lit(PARAM_CLOSE)}",
              f'{name}: {name}_one ("\\n" {name}_one)*',
              f"{raw}: {_NOCLOSE} {lit(PARAM_CLOSE)}"]


def _fixed_params(rules: list[str], name: str, params: dict[str, Any]) -> bool:
    """Rule ``name``: a non-empty run of the declared parameters in order. Returns whether the
    run may also be empty (no parameter required)."""
    props: dict[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    keys = list(props)
    for i, key in enumerate(keys):
        _param(rules, f"{name}_p{i}", key, props[key], defs)
    # tail_k: the parameters from k on, each required one present, each optional one maybe
    rules.append(f'{name}_t{len(keys)}: ""')
    for i in range(len(keys) - 1, 0, -1):  # tail_0 is never needed: a run starts at its first parameter
        item = f'"\\n" {name}_p{i}'
        rules.append(f"{name}_t{i}: {item if keys[i] in required else '(' + item + ')?'} {name}_t{i + 1}")
    first_required = next((i for i, k in enumerate(keys) if k in required), len(keys))
    alts = [f"{name}_p{j} {name}_t{j + 1}" for j in range(min(first_required + 1, len(keys)))]
    rules.append(f"{name}: " + " | ".join(alts))
    return first_required == len(keys)


def invoke(rules: list[str], name: str, tool_name: str, params: dict[str, Any]) -> None:
    """Rule ``name``: one ``<｜DSML｜invoke>`` of ``tool_name`` (encoder layout: no parameters is
    ``header\\n\\nclose``)."""
    head = lit(f'<{DSML}invoke name="{tool_name}">')
    props = params.get("properties") or {}
    if not props and params.get("additionalProperties", True) is not False and "properties" not in params:
        _generic_params(rules, f"{name}_args")
        may_be_empty = True
    elif props:
        may_be_empty = _fixed_params(rules, f"{name}_args", params)
    else:
        rules.append(f'{name}: {head} "\\n\\n" {lit(INVOKE_CLOSE)}')
        return
    args = f"{name}_args" + ("?" if may_be_empty else "")
    rules.append(f'{name}: {head} "\\n" {args} "\\n" {lit(INVOKE_CLOSE)}')


def tool_block(tools: list[tuple[str, dict[str, Any]]], *, many: bool) -> list[str]:
    """Rules for ``block``: the block after its ``<｜DSML｜tool_calls>`` opener, one call or several
    (each any of ``tools``)."""
    rules: list[str] = []
    for i, (tool_name, params) in enumerate(tools):
        invoke(rules, f"inv{i}", tool_name, params)
    rules.append("call: " + " | ".join(f"inv{i}" for i in range(len(tools))))
    calls = 'call ("\\n" call)*' if many else "call"
    rules.append(f'block: "\\n" {calls} "\\n" {lit(TOOL_CALLS_CLOSE)}')
    return rules


def forced_calls(tools: list[tuple[str, dict[str, Any]]], *, many: bool) -> str:
    """``tool_choice`` ``"required"`` (one or more calls) or a named function (one call)."""
    return header(tool_block(tools, many=many), f'{lit(chr(10) * 2 + TOOL_CALLS_OPEN)} block')


def auto_calls(tools: list[tuple[str, dict[str, Any]]], answer_schema: dict[str, Any] | None = None, *,
               many: bool = True) -> str:
    """``tool_choice: "auto"``: free text (or the ``response_format`` JSON), or a tool-call block whose
    markup is then constrained (one call when not ``many``: ``parallel_tool_calls: false``). The text
    before a block is the model's (the scanner drops its trailing whitespace as markup)."""
    rules = tool_block(tools, many=many)
    if answer_schema is None:
        return header(rules, "NOMARK | TEXT_OPEN block")
    rules.append(f"WS_OPEN: /[ \\t\\r\\n]*/ {lit(TOOL_CALLS_OPEN)}")
    return header(rules, f"{json_item(answer_schema)} | WS_OPEN block")


def check_name(name: str) -> bool:
    """Whether a tool or parameter name can be written inside ``name="..."`` and read back."""
    return bool(name) and re.fullmatch(r'[^"<>\n]*', name) is not None
