"""JSON Schemas: the base container schema and the payload schemas of known classes.

The files in `schemas/` are the contract. Validation on the hot path uses
validators compiled once by fastjsonschema (about a microsecond per payload),
each on first use, and, for the base schema every container pays for,
hand-written code; `jsonschema` checks schema files given by a user and
explains a failure (`explain`), off the hot path, imported only then (the
packaged files are checked by the test suite; a node does not pay the import
at every start). Both implement draft-07; the schema files use
only keywords on which the two agree (tested).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import fastjsonschema
import msgspec

from hmpnode.container.structure import check_structure

__all__ = ["SchemaSet", "schema_dir", "default_schemas"]


def schema_dir() -> Path:
    """Where the schema files are: packaged into the wheel as hmpnode/_schemas,
    or the repository's top-level schemas/ in a source checkout."""
    packaged = resources.files("hmpnode") / "_schemas"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "schemas"


def _load(path: Path, check: bool) -> dict[str, Any]:
    schema = json.loads(path.read_text(encoding="utf-8"))
    if check:
        import jsonschema

        jsonschema.Draft7Validator.check_schema(schema)
    return schema


class SchemaSet:
    """Compiled validators: `base` for hmp_container, one per known payload class."""

    def __init__(self, base: dict[str, Any], classes: dict[str, dict[str, Any]]):
        self.base_schema = base
        self.class_schemas = dict(classes)
        self._classes: dict[str, Callable[[Any], Any]] = {}
        self._typed: dict[str, Any] = {}  # class -> typed_schema (None: the validator only)

    @classmethod
    def from_dir(cls, directory: Path, *, check: bool = True) -> SchemaSet:
        """The schemas in `directory`; `check` validates each file against the
        draft-07 meta-schema first (SchemaError)."""
        base = _load(directory / "container.schema.json", check)
        classes = {p.stem: _load(p, check) for p in sorted((directory / "classes").glob("*.json"))}
        return cls(base, classes)

    @property
    def known_classes(self) -> Iterable[str]:
        return self.class_schemas.keys()

    def knows(self, class_name: str) -> bool:
        return class_name in self.class_schemas

    def _validator(self, class_name: str) -> Callable[[Any], Any] | None:
        validate = self._classes.get(class_name)
        if validate is None and class_name in self.class_schemas:
            # compiled on first use (a benign race between threads compiles twice), from a
            # copy: fastjsonschema rewrites the `$ref`s of the schema it is given in place
            validate = self._classes[class_name] = fastjsonschema.compile(copy.deepcopy(self.class_schemas[class_name]))
        return validate

    @staticmethod
    def check_base(hmp_container: Any) -> str | None:
        """None when valid, else a one-line explanation (hand-written twin of
        `base_schema`, see hmpnode.container.structure)."""
        return check_structure(hmp_container)

    def _typed_for(self, class_name: str) -> Any:
        typed = self._typed.get(class_name, _UNTYPED)
        if typed is _UNTYPED:
            typed = self._typed[class_name] = typed_schema(self.class_schemas.get(class_name))
        return typed

    def check_class(self, class_name: str, payload: Any) -> str | None:
        typed = self._typed_for(class_name)
        if typed is not None:
            try:
                msgspec.convert(payload, typed)
                return None  # the typed form accepts only what the schema accepts
            except Exception:  # noqa: BLE001 - ValidationError, or any doubt: the validator decides (and explains)
                pass
        validate = self._validator(class_name)
        if validate is None:
            return None
        try:
            validate(payload)
        except fastjsonschema.JsonSchemaException:
            return self.explain(self.class_schemas[class_name], payload)
        return None

    @staticmethod
    def explain(schema: dict[str, Any], instance: Any) -> str:
        """Human-readable reason from jsonschema (slow path, failures only)."""
        import jsonschema

        error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(instance))
        if error is None:  # the two libraries disagree; fastjsonschema is stricter on `$`
            return "does not match its schema"
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        if error.validator in ("anyOf", "oneOf") and error.context:
            # "is not valid under any of the given schemas" repeats the whole instance;
            # name what each alternative wanted instead (peer_announce: addresses or key_is_falsified)
            wanted = " or ".join(dict.fromkeys(e.message[:120] for e in error.context))
            return f"{where}: none of the alternatives holds: {wanted}"[:400]
        return f"{where}: {error.message[:200]}"


_UNTYPED = object()
#: keywords that change nothing a payload is checked against
_ANNOTATIONS = frozenset({"$schema", "$id", "title", "description", "definitions", "$comment", "examples"})
_KEYWORDS = {
    "string": frozenset({"type", "minLength", "maxLength", "pattern"}),
    "number": frozenset({"type", "minimum", "maximum"}),
    "integer": frozenset({"type", "minimum", "maximum"}),
    "boolean": frozenset({"type"}),
    "array": frozenset({"type", "items", "minItems", "maxItems"}),
    "object": frozenset({"type", "properties", "required"}),
}


_DOLLAR = re.compile(r"(?<!\\)\$")  # an unescaped `$` (fastjsonschema reads it as \Z)


class _Untypable(Exception):
    pass


def typed_schema(schema: dict[str, Any] | None) -> Any:
    """A msgspec type that `msgspec.convert` accepts a payload into only when `schema`
    (draft-07) accepts it, or None when the schema uses anything beyond the plain subset
    translated here (object properties/required, string lengths/pattern, number and
    integer bounds, boolean, arrays of those, local `$ref`s). msgspec checks it in C:
    ~4 k instructions for a goal payload against ~21 k through fastjsonschema's code
    (docs/benchmarks-journal.md, "Issue 15, session 5: verification"). What it refuses goes to the validator,
    which decides: only "typed accepts => schema accepts" matters (tests/test_schema_typed.py)."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    try:
        return _typed(schema, schema, "Payload")
    except (_Untypable, TypeError, ValueError, KeyError, re.error, RecursionError):  # a $ref cycle
        return None


def _typed(node: Any, root: dict[str, Any], name: str) -> Any:
    if not isinstance(node, dict):
        raise _Untypable
    if "$ref" in node:
        ref = node["$ref"]
        if set(node) - _ANNOTATIONS - {"$ref"} or not isinstance(ref, str) or not ref.startswith("#/definitions/"):
            raise _Untypable
        return _typed(root["definitions"][ref[len("#/definitions/"):]], root, name)
    kind = node.get("type")
    if not isinstance(kind, str) or kind not in _KEYWORDS or set(node) - _ANNOTATIONS - _KEYWORDS[kind]:
        raise _Untypable
    if kind == "string":
        pattern = node.get("pattern")
        if pattern is not None:  # searched, with `$` as the end of the text: as fastjsonschema does
            pattern = _DOLLAR.sub(r"\\Z", pattern)
        meta = {"min_length": node.get("minLength"), "max_length": node.get("maxLength"), "pattern": pattern}
        return _annotated(str, meta)
    if kind in ("number", "integer"):
        lo, hi = node.get("minimum"), node.get("maximum")
        for bound in (lo, hi):
            if bound is not None and (type(bound) not in (int, float) or float(bound) != bound):
                raise _Untypable  # a bound a float cannot hold exactly
        # ints stay ints (compared exactly); a float bound on an int is its ceiling/floor
        whole = _annotated(int, {"ge": None if lo is None else math.ceil(lo), "le": None if hi is None else math.floor(hi)})
        if kind == "integer":
            return whole  # (a float like 1.0, which draft-07 calls an integer, goes to the validator)
        return whole | _annotated(float, {"ge": lo, "le": hi})
    if kind == "boolean":
        return bool
    if kind == "array":
        items = _typed(node["items"], root, name + "Item") if "items" in node else Any
        return _annotated(list[items], {"min_length": node.get("minItems"), "max_length": node.get("maxItems")})
    required = node.get("required", [])
    properties = node.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict) or not set(required) <= set(properties):
        raise _Untypable  # a required member with no property schema: left to the validator
    fields = []
    for i, (key, sub) in enumerate(properties.items()):
        typed = _typed(sub, root, f"{name}_{i}")
        if key in required:
            fields.append((f"f{i}", typed, msgspec.field(name=key)))
        else:
            fields.append((f"f{i}", typed | msgspec.UnsetType, msgspec.field(default=msgspec.UNSET, name=key)))
    return msgspec.defstruct(name, fields, kw_only=True)  # unknown members allowed, as in JSON Schema


def _annotated(kind: Any, meta: dict[str, Any]) -> Any:
    given = {k: v for k, v in meta.items() if v is not None}
    return Annotated[kind, msgspec.Meta(**given)] if given else kind


@functools.cache
def default_schemas() -> SchemaSet:
    """The packaged schemas (checked against the meta-schema by the tests)."""
    return SchemaSet.from_dir(schema_dir(), check=False)
