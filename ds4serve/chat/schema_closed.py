"""The JSON Schema a grammar generates from: objects that list ``properties`` and say nothing about
other keys are closed (``additionalProperties: false``), as xgrammar's strict mode and outlines do.

Why: JSON Schema lets an object without ``additionalProperties`` hold any extra key, and a sampler
that honours that lets a model (a small or a distracted one) wander into unlisted keys until
``length``. Clients that send a schema without ``strict`` (instructor's JSON_SCHEMA mode, most tool
definitions) mean "these keys". Only generation changes: the schema shown to the model in the prompt
and the one an answer is checked against stay the client's.

What keeps its meaning: an explicit ``additionalProperties`` (``true`` or a schema), an object without
the ``properties`` keyword (``{"type": "object"}``: any object, e.g. ``json_object`` mode; an empty
``properties: {}`` lists no keys, so it is closed to ``{}``, as a tool with it takes no arguments), and
objects whose keys other keywords extend (``patternProperties``, ``unevaluatedProperties``, ``allOf``, ``anyOf``,
``oneOf``, ``$ref``, ``if``, ``dependentSchemas``): closing those would refuse keys the schema allows.
For the same reason a member of an ``allOf`` (or a ``$defs`` entry used as one, or beside sibling
``properties``) is not closed itself; what is inside it is. Nothing under ``not`` or ``if`` is
touched (closing there would widen what is allowed).
"""

from __future__ import annotations

import json
from typing import Any

_EXTENDED_BY = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                "$ref", "if", "dependentSchemas", "not")
_MAPS = ("properties", "patternProperties", "dependentSchemas")
_DEFS = ("$defs", "definitions")
_ONE = ("items", "additionalProperties", "unevaluatedItems", "contains", "then", "else")
_LISTS = ("prefixItems", "anyOf", "oneOf")


def closed(schema: Any) -> Any:
    """A copy of ``schema`` with every object that lists its properties closed (see the module doc);
    ``schema`` itself is not changed. Iterative, so nesting depth costs no stack."""
    if not isinstance(schema, dict):
        return schema
    root = json.loads(json.dumps(schema))  # a private copy: the prompt and the checks keep the client's
    shared = _defs_extended_elsewhere(root)
    stack: list[tuple[Any, bool]] = [(root, True)]
    while stack:
        node, closable = stack.pop()
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if closable and isinstance(props, dict) and not any(k in node for k in _EXTENDED_BY):
            node["additionalProperties"] = False
        stack += _children(node, shared)
    return root


def _children(node: dict[str, Any], shared: set[str]) -> list[tuple[Any, bool]]:
    """The sub-schemas of ``node`` to visit, each with whether it may be closed itself."""
    out: list[tuple[Any, bool]] = []
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            out += [(sub, True) for sub in node[key].values()]
    for key in _DEFS:
        if isinstance(node.get(key), dict):
            out += [(sub, name not in shared) for name, sub in node[key].items()]
    out += [(node[key], True) for key in _ONE if isinstance(node.get(key), dict)]
    if isinstance(node.get("items"), list):  # the older tuple form of prefixItems
        out += [(sub, True) for sub in node["items"]]
    for key in _LISTS:
        if isinstance(node.get(key), list):
            out += [(sub, True) for sub in node[key]]
    if isinstance(node.get("allOf"), list):
        alone = len(node["allOf"]) == 1 and "properties" not in node
        out += [(sub, alone) for sub in node["allOf"]]
    return out


def _defs_extended_elsewhere(root: dict[str, Any]) -> set[str]:
    """Names of ``$defs`` / ``definitions`` entries that some object combines with other keys (an
    ``allOf`` of several members or beside ``properties``, or a ``$ref`` beside ``properties``)."""
    names: set[str] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
            continue
        if not isinstance(node, dict):
            continue
        members = node.get("allOf") if isinstance(node.get("allOf"), list) else []
        if len(members) > 1 or "properties" in node:
            refs = [m.get("$ref") for m in members if isinstance(m, dict)] + [node.get("$ref")]
            names.update(r.rsplit("/", 1)[-1] for r in refs if isinstance(r, str) and r.startswith("#/"))
        stack += list(node.values())
    return names
