"""A structural check of the JSON Schemas clients send (tool parameters, ``json_schema``).

Not a full meta-schema validation (no runtime dependency does that here): it catches what would
make a schema meaningless to the model or to a later grammar, with a path to the bad keyword:
a ``type`` that is not a JSON type name, ``properties`` / ``$defs`` that are not objects of
schemas, ``required`` that is not a list of strings, ``enum`` that is not a list, and
sub-schemas (``items``, ``anyOf``...) of the wrong shape.
"""

from __future__ import annotations

from typing import Any

TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def schema_problem(schema: Any, path: str) -> str | None:
    """``"<path>: what is wrong"`` for the first problem found, or None."""
    stack: list[tuple[Any, str]] = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"{where} must be a schema object"
        problem = _own_problem(node, where)
        if problem:
            return problem
        stack += [(sub, f"{where}.{k}.{name}") for k in _MAPS if isinstance(node.get(k), dict)
                  for name, sub in node[k].items()]
        stack += [(sub, f"{where}.{k}[{i}]") for k in _LISTS if isinstance(node.get(k), list)
                  for i, sub in enumerate(node[k])]
        stack += [(node[k], f"{where}.{k}") for k in _ONE if k in node]
    return None


def _own_problem(node: dict[str, Any], where: str) -> str | None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in TYPES for k in kinds):
        return f"{where}.type must be one of {sorted(TYPES)} (or a list of them), got {kind!r}"
    for k in _MAPS:
        if k in node and not isinstance(node[k], dict):
            return f"{where}.{k} must be an object of schemas"
    for k in _LISTS:
        if k in node and not isinstance(node[k], list):
            return f"{where}.{k} must be a list of schemas"
    req = node.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        return f"{where}.required must be a list of property names"
    if "enum" in node and not isinstance(node["enum"], list):
        return f"{where}.enum must be a list"
    return None
