"""Tests for the container payload schemas in schemas/classes/.

The node validates payloads with fastjsonschema (compiled, fast) and keeps
jsonschema as the reference implementation, so every schema must give the same
answer in both. These tests check that:

* each schema is a well-formed draft-07 schema with the agreed header,
* each schema uses only keywords the two libraries implement identically,
* the example payloads in tests/data/class_examples.json are accepted
  (valid) or rejected (invalid) by both libraries,
* on arbitrary and on mutated payloads the two libraries always agree
  (hypothesis).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import fastjsonschema
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_DIR = ROOT / "schemas" / "classes"
EXAMPLES_FILE = Path(__file__).resolve().parent / "data" / "class_examples.json"

CLASSES = [
    # network and Mesh Container Exchange (HMP-0005 §4-5)
    "peer_announce",
    "peer_query",
    "container_index",
    "container_delta",
    "container_request",
    "container_response",
    "container_ack",
    "referenced-by_exchange",
    "evaluations_exchange",
    # knowledge classes (HMP-0005 §6)
    "goal",
    "task",
    "workflow_entry",
    "diary_entry",
    "vote",
    "consensus_result",
    "semantic_node",
    "event",
]

# Keywords that both jsonschema's Draft7Validator and fastjsonschema's draft-07
# generator implement identically, plus the annotations that neither checks.
VALIDATION_KEYWORDS = {
    "type", "properties", "required", "items", "enum", "const", "pattern",
    "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems",
    "additionalProperties", "oneOf", "anyOf", "$ref",
}
ANNOTATION_KEYWORDS = {"$schema", "$id", "title", "description", "definitions"}
ROOT_ONLY_KEYWORDS = {"$schema", "$id", "definitions"}

# Python's `$` also matches just before a final "\n" and jsonschema uses the
# pattern as is, while fastjsonschema rewrites `$` to `\Z`; a pattern may end
# with `$` only behind this guard.
END_GUARD = "(?!\\n)$"


def _load_schema(cls: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{cls}.json").read_text(encoding="utf-8"))


SCHEMAS = {cls: _load_schema(cls) for cls in CLASSES}
REFERENCE = {cls: jsonschema.Draft7Validator(schema) for cls, schema in SCHEMAS.items()}
# fastjsonschema.compile rewrites every "$ref" of the dict it is given into an
# absolute URI, in place: always hand it a copy.
COMPILED = {cls: fastjsonschema.compile(copy.deepcopy(schema)) for cls, schema in SCHEMAS.items()}
EXAMPLES = json.loads(EXAMPLES_FILE.read_text(encoding="utf-8"))


def outcomes(cls: str, payload) -> tuple[bool, bool]:
    """(jsonschema accepts, fastjsonschema accepts) for a payload of class cls."""
    reference = REFERENCE[cls].is_valid(payload)
    try:
        COMPILED[cls](copy.deepcopy(payload))
        fast = True
    except fastjsonschema.JsonSchemaValueException:
        fast = False
    return reference, fast


def iter_subschemas(schema: dict, path: str = "#"):
    """Yield (path, subschema) for every schema node, following the draft-07 structure."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from iter_subschemas(sub, f"{path}/properties/{name}")
    for name, sub in schema.get("definitions", {}).items():
        yield from iter_subschemas(sub, f"{path}/definitions/{name}")
    if isinstance(schema.get("items"), dict):
        yield from iter_subschemas(schema["items"], f"{path}/items")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from iter_subschemas(schema["additionalProperties"], f"{path}/additionalProperties")
    for keyword in ("anyOf", "oneOf"):
        for i, sub in enumerate(schema.get(keyword, [])):
            yield from iter_subschemas(sub, f"{path}/{keyword}/{i}")


def property_names(schema: dict) -> list[str]:
    names = set()
    for _, sub in iter_subschemas(schema):
        names.update(sub.get("properties", {}))
    return sorted(names)


# ----------------------------------------------------------------- the files


def test_one_schema_file_per_class():
    on_disk = sorted(p.stem for p in SCHEMA_DIR.glob("*.json"))
    assert on_disk == sorted(CLASSES)


@pytest.mark.parametrize("cls", CLASSES)
def test_schema_is_valid_draft07(cls):
    schema = SCHEMAS[cls]
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["$id"] == f"https://hmpnode.dev/schemas/classes/{cls}.json"
    assert schema["title"]
    assert "HMP-0005 §" in schema["description"], "description must cite the spec section"
    assert schema["type"] == "object", "a schema describes the payload object"


@pytest.mark.parametrize("cls", CLASSES)
def test_schema_uses_only_portable_keywords(cls):
    for path, sub in iter_subschemas(SCHEMAS[cls]):
        keywords = set(sub)
        assert keywords <= VALIDATION_KEYWORDS | ANNOTATION_KEYWORDS, (path, keywords)
        if path != "#":
            assert not keywords & ROOT_ONLY_KEYWORDS, (path, keywords)
        if "$ref" in sub:
            assert set(sub) == {"$ref"}, f"{path}: $ref must stand alone"
            target = sub["$ref"]
            assert target.startswith("#/definitions/"), (path, target)
            assert target.split("/")[-1] in SCHEMAS[cls].get("definitions", {}), (path, target)
        # unrecognized fields MUST be ignored (§3.2): no closed objects
        assert sub.get("additionalProperties", True) is not False, path
        if "items" in sub:
            assert isinstance(sub["items"], dict), f"{path}: tuple-form items"
        if "pattern" in sub:
            pattern = sub["pattern"]
            re.compile(pattern)
            assert "$" not in pattern.replace(END_GUARD, ""), f"{path}: unguarded $ in {pattern!r}"
            assert "\\d" not in pattern, f"{path}: \\d matches non-ASCII digits in Python; use [0-9]"
        for bound in ("minimum", "maximum"):
            if bound in sub:
                types = sub.get("type")
                types = {types} if isinstance(types, str) else set(types or ())
                # without a type, fastjsonschema applies bounds to booleans and jsonschema does not
                assert types and types <= {"number", "integer", "boolean"}, (path, bound)
        if "enum" in sub or "const" in sub:
            values = sub.get("enum", [sub.get("const")])
            # Python's True == 1 makes numeric enums disagree between the libraries
            assert all(isinstance(v, str) for v in values), (path, values)


def test_shared_definitions_are_identical_across_files():
    seen: dict[str, tuple[str, dict]] = {}
    for cls, schema in SCHEMAS.items():
        for name, definition in schema.get("definitions", {}).items():
            if name in seen:
                first_cls, first = seen[name]
                assert definition == first, f"definition {name!r} differs in {cls} and {first_cls}"
            else:
                seen[name] = (cls, definition)


# ----------------------------------------------------------------- examples


def test_every_class_has_examples():
    assert sorted(k for k in EXAMPLES if not k.startswith("_")) == sorted(CLASSES)
    for cls in CLASSES:
        assert len(EXAMPLES[cls]["valid"]) >= 1, cls
        assert len(EXAMPLES[cls]["invalid"]) >= 2, cls


def _cases(kind: str):
    return [
        pytest.param(cls, case["payload"], id=f"{cls}:{case['name']}")
        for cls in CLASSES
        for case in EXAMPLES[cls][kind]
    ]


@pytest.mark.parametrize(("cls", "payload"), _cases("valid"))
def test_valid_example_accepted_by_both(cls, payload):
    errors = [e.message for e in REFERENCE[cls].iter_errors(payload)]
    assert errors == []
    assert outcomes(cls, payload) == (True, True)


@pytest.mark.parametrize(("cls", "payload"), _cases("invalid"))
def test_invalid_example_rejected_by_both(cls, payload):
    assert outcomes(cls, payload) == (False, False)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("payload", [None, [], "payload", 1, True], ids=repr)
def test_payload_must_be_an_object(cls, payload):
    assert outcomes(cls, payload) == (False, False)


# ----------------------------------------------------------------- differential

# Strings that sit on the edges of the patterns, so that generated payloads
# reach the pattern checks and not only the type checks.
EDGE_STRINGS = [
    "",
    "did:",
    "did:hmp:agent123",
    "did:hmp:container:abc123",
    "did:hmp:agent123\n",
    "DID:hmp:agent123",
    "2025-10-10T12:00:00Z",
    "2025-10-10T12:00:00.123456Z",
    "2025-10-10T12:00:00.1234567Z",
    "2025-10-10T12:00:00Z\n",
    "2025-10-10T12:00:00+00:00",
    "\u0662\u0660\u0662\u0665-10-10T12:00:00Z",  # Arabic-Indic digits
    "sha256:" + "ab" * 32,
    "sha256:" + "ab" * 32 + "\n",
    "sha256:" + "AB" * 32,
    "sha256:abcd...",
    "0000" + "f" * 60,
    "0000" + "f" * 60 + "\n",
    "0000abf39d...",
    "4vJ9JU1bJJE96FWSJKvHsmmFADCg4gpZQff4P3bkLKi",
    "BASE58(...)",
    "3q2-7w" * 14 + "AB",
    "3q2-7w" * 14 + "AB==",
    "BASE64URL(...)",
    "ed25519",
    "processed",
    "declined",
    "pending",
    "in_progress",
    "tcp://1.2.3.4:4000",
]
EDGE_KEYS = ["did:hmp:container:abc123", "did:hmp:container:def456", "agents_class", "L1"]


def json_values(keys: list[str]):
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**53), max_value=2**53)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12)
        | st.sampled_from(EDGE_STRINGS)
    )
    key_strategy = st.sampled_from(keys) | st.text(max_size=8)
    return st.recursive(
        leaves,
        lambda children: st.lists(children, max_size=4)
        | st.dictionaries(key_strategy, children, max_size=6),
        max_leaves=25,
    )


def payloads(cls: str):
    keys = property_names(SCHEMAS[cls]) + EDGE_KEYS
    values = json_values(keys)
    key_strategy = st.sampled_from(keys) | st.text(max_size=8)
    return st.dictionaries(key_strategy, values, max_size=8) | values


PAYLOADS = {cls: payloads(cls) for cls in CLASSES}
VALUES = {cls: json_values(property_names(SCHEMAS[cls]) + EDGE_KEYS) for cls in CLASSES}


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


@st.composite
def mutated_examples(draw, cls: str):
    """A valid example with one node replaced, removed, or given an extra member."""
    base = copy.deepcopy(draw(st.sampled_from(EXAMPLES[cls]["valid"]))["payload"])
    path = draw(st.sampled_from(list(_paths(base))))
    keys = property_names(SCHEMAS[cls]) + EDGE_KEYS
    new_value = draw(VALUES[cls])
    if not path:
        return new_value
    parent = base
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    action = draw(st.sampled_from(["replace", "delete", "add_member"]))
    if action == "replace":
        parent[last] = new_value
    elif action == "delete":
        del parent[last]
    elif isinstance(parent[last], dict):
        parent[last][draw(st.sampled_from(keys) | st.text(max_size=8))] = new_value
    else:
        parent[last] = new_value
    return base


@pytest.mark.parametrize("cls", CLASSES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_libraries_agree_on_arbitrary_payloads(cls, data):
    payload = data.draw(PAYLOADS[cls], label="payload")
    reference, fast = outcomes(cls, payload)
    assert reference == fast, f"jsonschema={reference} fastjsonschema={fast}"


@pytest.mark.parametrize("cls", CLASSES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_libraries_agree_on_mutated_examples(cls, data):
    payload = data.draw(mutated_examples(cls), label="payload")
    reference, fast = outcomes(cls, payload)
    assert reference == fast, f"jsonschema={reference} fastjsonschema={fast}"


def test_packaged_schema_set_passes_the_meta_schema_check_the_node_skips():
    """The node loads its packaged schemas without re-checking them at every
    start (hmpnode.container.schema.default_schemas); this is that check."""
    from hmpnode.container.schema import SchemaSet, default_schemas, schema_dir

    checked = SchemaSet.from_dir(schema_dir(), check=True)
    assert sorted(checked.known_classes) == sorted(default_schemas().known_classes)
    broken = dict(checked.class_schemas)
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.Draft7Validator.check_schema({**broken["goal"], "type": 12})
