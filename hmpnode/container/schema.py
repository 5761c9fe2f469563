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

import functools
import json
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import fastjsonschema

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
            # compiled on first use (a benign race between threads compiles twice)
            validate = self._classes[class_name] = fastjsonschema.compile(self.class_schemas[class_name])
        return validate

    @staticmethod
    def check_base(hmp_container: Any) -> str | None:
        """None when valid, else a one-line explanation (hand-written twin of
        `base_schema`, see hmpnode.container.structure)."""
        return check_structure(hmp_container)

    def check_class(self, class_name: str, payload: Any) -> str | None:
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


@functools.cache
def default_schemas() -> SchemaSet:
    """The packaged schemas (checked against the meta-schema by the tests)."""
    return SchemaSet.from_dir(schema_dir(), check=False)
