"""The typed (msgspec) class-schema check against the schema it is translated from.

`SchemaSet.check_class` first tries `msgspec.convert(payload, typed_schema(schema))`
and accepts the payload when that succeeds; anything it refuses goes to the
fastjsonschema validator, which decides and explains. So the one property that
matters is: **typed accepts => the validator accepts** (and, so that the shortcut
is worth having, it accepts the usual valid payloads). Inputs: for every packaged
class schema with a typed form, payloads built member by member from each property
schema's edge values (lengths at and past their bounds, numbers at and past theirs,
big integers, booleans where numbers go, strings that break a pattern or end in a
newline, null, nested wrong types), missing and extra members; plus hand-written
schemas for each keyword the translation handles and some it must decline.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import fastjsonschema
import msgspec
import pytest

from hmpnode.container.schema import SchemaSet, default_schemas, typed_schema

#: the content classes on the ingest hot path must take the typed check
HOT = ("goal", "task", "diary_entry", "event", "semantic_node", "workflow_entry")
WRONG = [None, True, False, 0, 1, -1, 0.5, 2**53 + 1, -(2**64), 1e300, "", "x", "did:x", [], ["x"], {}, {"a": 1}]


def _resolve(node: Any, root: dict[str, Any]) -> Any:
    while isinstance(node, dict) and "$ref" in node:
        node = root["definitions"][node["$ref"].split("/")[-1]]
    return node


_EDGES: dict[tuple[str, int], list[Any]] = {}


def edge_values(node: Any, root: dict[str, Any], rnd: random.Random, depth: int = 0) -> list[Any]:
    """Values at and just past every bound of `node`, and values of other types (made once per node)."""
    node = _resolve(node, root)
    key = (json.dumps(node, sort_keys=True), depth)
    if key not in _EDGES:
        _EDGES[key] = _edge_values(node, root, rnd, depth)
    return _EDGES[key]


def _edge_values(node: Any, root: dict[str, Any], rnd: random.Random, depth: int) -> list[Any]:
    out = list(WRONG)
    if not isinstance(node, dict):
        return out
    kind = node.get("type")
    if kind == "string":
        lo, hi = node.get("minLength", 0), node.get("maxLength", 40)
        for n in {lo, max(lo - 1, 0), min(hi, 3000), min(hi + 1, 3001), 5}:
            out += ["a" * n, "did:" + "x" * max(n - 4, 0), "é" * n, "🌍" * n]
        out += ["did:ok\n", "\ndid:x", "DID:x", "0" * 64, "0" * 64 + "\n", "sha256:" + "a" * 64,
                "2026-11-29T10:15:00Z", "2026-11-29T10:15:00Z\n", "1" * 40, "abc=", "ab+c", "\ud800"]
    elif kind in ("number", "integer"):
        for bound in (node.get("minimum"), node.get("maximum")):
            if bound is not None:
                out += [bound, bound - 1, bound + 1, bound - 0.5, bound + 0.5, float(bound), bound + 1e-9, bound - 1e-9]
        out += [0, 1, 0.25, 1.0, 2.0, 10**20, 2.0**53, 2**53 + 1]
    elif kind == "array" and depth < 3:
        items = node.get("items", {})
        one = edge_values(items, root, rnd, depth + 1)
        for n in {0, node.get("minItems", 0), node.get("maxItems", 3), node.get("maxItems", 3) + 1, 2}:
            n = min(n, 1100)
            out.append([rnd.choice(one) for _ in range(n)])
            out.append([one[0]] * n)
    elif kind == "object" and depth < 3:
        out += [object_value(node, root, rnd, depth + 1) for _ in range(8)]
    return out


def object_value(node: dict[str, Any], root: dict[str, Any], rnd: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object whose members are edge values; sometimes a required one is missing, an extra one added."""
    value = {}
    for key, sub in node.get("properties", {}).items():
        if key in node.get("required", ()) and rnd.random() < 0.95 or rnd.random() < 0.6:
            value[key] = rnd.choice(edge_values(sub, root, rnd, depth))
    if rnd.random() < 0.3:
        value["extra_" + str(rnd.randrange(3))] = rnd.choice(WRONG)
    return value


def valid_value(node: Any, root: dict[str, Any]) -> Any:
    """A simple value the property schema accepts."""
    node = _resolve(node, root)
    kind = node.get("type")
    if kind == "string":
        return "did:" + "x" * max(node.get("minLength", 0), 1) if "pattern" in node else "t" * max(node.get("minLength", 0), 1)
    if kind in ("number", "integer"):
        return node.get("minimum", 0)
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    return {k: valid_value(v, root) for k, v in node.get("properties", {}).items() if k in node.get("required", ())}


def typed_accepts(typed: Any, payload: Any) -> bool:
    try:
        msgspec.convert(payload, typed)
        return True
    except msgspec.ValidationError:
        return False


def validator_accepts(validate: Any, payload: Any) -> bool:
    try:
        validate(payload)
        return True
    except fastjsonschema.JsonSchemaException:
        return False


def test_the_hot_classes_have_a_typed_form():
    schemas = default_schemas()
    for name in HOT:
        schemas.check_class(name, {})  # compiles the validator: the schema must stay as it was
        assert typed_schema(schemas.class_schemas[name]) is not None, name


@pytest.mark.parametrize("name", sorted(default_schemas().class_schemas))
def test_typed_accepts_only_what_the_schema_accepts(name):
    schema = default_schemas().class_schemas[name]
    typed = typed_schema(schema)
    if typed is None:
        pytest.skip("no typed form: the validator alone")
    validate = fastjsonschema.compile(copy.deepcopy(schema))
    rnd = random.Random(name)
    accepted = both = 0
    payloads = [object_value(schema, schema, rnd) for _ in range(1500)] + WRONG
    payloads.append({k: valid_value(v, schema) for k, v in schema.get("properties", {}).items()})
    for payload in payloads:
        if typed_accepts(typed, payload):
            accepted += 1
            assert validator_accepts(validate, payload), f"{name}: typed accepts {payload!r:.300}"
        both += validator_accepts(validate, payload)
    assert accepted >= 1 and both >= accepted, (accepted, both)


def test_typed_keywords():
    """Each translated keyword, at its edges (typed accepts exactly these here)."""
    schema = {
        "type": "object", "required": ["s"],
        "properties": {
            "s": {"$ref": "#/definitions/did"},
            "n": {"type": "number", "minimum": 0.5, "maximum": 2},
            "i": {"type": "integer", "minimum": -1, "maximum": 1},
            "b": {"type": "boolean"},
            "a": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "maxLength": 1}},
            "o": {"type": "object", "required": ["k"], "properties": {"k": {"type": "integer"}}},
        },
        "definitions": {"did": {"type": "string", "minLength": 5, "maxLength": 8, "pattern": "^did:[a-z]+$"}},
    }
    typed = typed_schema(schema)
    validate = fastjsonschema.compile(copy.deepcopy(schema))
    cases = [
        ({"s": "did:ab"}, True), ({"s": "did:abcd"}, True), ({"s": "did:abcde"}, False), ({"s": "did:"}, False),
        ({"s": "did:ab\n"}, False), ({"s": "xdid:ab"}, False), ({}, False), ({"s": 5}, False),
        ({"s": "did:ab", "n": 0.5}, True), ({"s": "did:ab", "n": 2}, True), ({"s": "did:ab", "n": 1}, True),
        ({"s": "did:ab", "n": 0}, False), ({"s": "did:ab", "n": 2.0000001}, False), ({"s": "did:ab", "n": True}, False),
        ({"s": "did:ab", "n": 2**53 + 1}, False), ({"s": "did:ab", "i": 1}, True), ({"s": "did:ab", "i": 2}, False),
        ({"s": "did:ab", "i": False}, False), ({"s": "did:ab", "b": False}, True), ({"s": "did:ab", "b": 0}, False),
        ({"s": "did:ab", "a": ["x"]}, True), ({"s": "did:ab", "a": []}, False), ({"s": "did:ab", "a": ["x", "y", "z"]}, False),
        ({"s": "did:ab", "a": ["xy"]}, False), ({"s": "did:ab", "o": {"k": 1, "z": None}}, True),
        ({"s": "did:ab", "o": {}}, False), ({"s": "did:ab", "o": []}, False), ({"s": "did:ab", "extra": [None]}, True),
        ({"s": "did:ab", "n": None}, False), ([], False), ("did:ab", False),
    ]
    for payload, want in cases:
        assert typed_accepts(typed, payload) is want, payload
        if want:
            assert validator_accepts(validate, payload), payload


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
    {"type": "object", "properties": {"a": {"enum": [1, 2]}}},
    {"type": "object", "properties": {"a": {"type": ["string", "null"]}}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}},
    {"type": "object", "properties": {"a": {"type": "string", "format": "date-time"}}},
    {"type": "object", "required": ["b"], "properties": {"a": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"type": "number", "maximum": 2**60 + 1}}},
    {"type": "object", "properties": {"a": {"type": "array", "items": [{"type": "string"}]}}},
    {"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}},
    {"type": "array"},
    None,
])
def test_what_the_translation_declines(schema):
    assert typed_schema(schema) is None


def test_check_class_answers_as_the_validator_alone():
    """check_class with the typed shortcut and without it (the hot classes, same payloads;
    the other classes have no typed form and take the validator either way)."""
    typed_set = default_schemas()
    plain = SchemaSet(typed_set.base_schema, typed_set.class_schemas)
    plain._typed = {name: None for name in plain.class_schemas}  # the validator only
    rnd = random.Random(5)
    for name in HOT:
        schema = typed_set.class_schemas[name]
        for _ in range(30):
            payload = object_value(schema, schema, rnd)
            assert typed_set.check_class(name, payload) == plain.check_class(name, payload), (name, payload)


@pytest.mark.parametrize("dropped", ["pattern", "max_length", "le"])
def test_a_planted_gap_is_caught(monkeypatch, dropped):
    """The payloads above are not blind: a translation that loses one keyword accepts
    what the validator refuses on at least one of them."""
    import hmpnode.container.schema as schema_module

    real = schema_module._annotated
    monkeypatch.setattr(schema_module, "_annotated", lambda kind, meta: real(kind, {**meta, dropped: None}))
    caught = 0
    for name in HOT:
        schema = default_schemas().class_schemas[name]
        typed, validate = typed_schema(schema), fastjsonschema.compile(copy.deepcopy(schema))
        rnd = random.Random(name)
        payloads = [object_value(schema, schema, rnd) for _ in range(1500)]
        caught += sum(typed_accepts(typed, p) and not validator_accepts(validate, p) for p in payloads)
    assert caught, f"dropping {dropped} went unnoticed"


def test_a_ref_cycle_is_declined_not_raised():
    """A class schema whose `$ref` leads back to itself has no typed form (the validator
    alone decides); the translation used to raise RecursionError out of check_class, and
    every container of that class came back `malformed`."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}},
              "definitions": {"x": {"$ref": "#/definitions/x"}}}
    assert typed_schema(schema) is None
