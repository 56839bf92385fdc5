"""A deterministic suite of varied JSON schemas with a prompt each, for the structured-output
tests (engine, e2e) and bench/structured.py.

Schema i is built from its own seeded generator: an object about one theme with two to five
fields drawn from strings (bounded, with a pattern, or a format), integers and numbers with
ranges, booleans, enums, arrays with minItems / maxItems, nullable fields, nested objects and
anyOf; some fields optional. As OpenAI's strict mode has them, objects are closed
(additionalProperties: false) and strings are bounded, so that a small model's answer fits in
~200 tokens (an open object lets it invent keys until max_tokens).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Schema = dict[str, Any]

THEMES = [
    ("a person", ["name", "nickname", "city", "job"]),
    ("a book", ["title", "author", "genre", "publisher"]),
    ("a product in a shop", ["name", "brand", "category", "sku"]),
    ("a city", ["name", "country", "region", "mayor"]),
    ("a movie", ["title", "director", "studio", "genre"]),
    ("a recipe", ["dish", "cuisine", "chef", "course"]),
    ("a planet", ["name", "star", "discoverer", "type"]),
    ("a football team", ["name", "coach", "stadium", "league"]),
    ("a song", ["title", "artist", "album", "label"]),
    ("a car", ["model", "maker", "color", "engine"]),
]
# jsonschema's FormatChecker checks date, email, uuid, ipv4 (date-time needs a package it lacks)
FORMATS = ["date", "email", "uuid", "ipv4", "date-time"]
PATTERNS = [r"^[A-Z]{3}-[0-9]{3}$", r"^[a-z]{1,12}$", r"^\+?[0-9]{6,10}$", r"^v[0-9]\.[0-9]$"]
ENUMS = [["low", "medium", "high"], ["red", "green", "blue", "black"], ["yes", "no"],
         ["draft", "published", "archived"]]  # fmt: skip


def _string(rng: random.Random) -> Schema:
    return {"type": "string", "minLength": 1, "maxLength": rng.choice([12, 20, 30])}


def _pattern(rng: random.Random) -> Schema:
    return {"type": "string", "pattern": rng.choice(PATTERNS)}


def _format(rng: random.Random) -> Schema:
    return {"type": "string", "format": rng.choice(FORMATS), "maxLength": 40}  # uuid: 36


def _integer(rng: random.Random) -> Schema:
    low = rng.choice([0, 1, 1900, -50])
    return {"type": "integer", "minimum": low, "maximum": low + rng.choice([10, 100, 125])}


def _number(rng: random.Random) -> Schema:
    return {"type": "number", "minimum": rng.choice([0, -10.5]), "maximum": rng.choice([5, 99.9])}


def _boolean(rng: random.Random) -> Schema:
    return {"type": "boolean"}


def _enum(rng: random.Random) -> Schema:
    return {"type": "string", "enum": rng.choice(ENUMS)}


def _array(rng: random.Random) -> Schema:
    items = rng.choice([_integer, _enum, lambda r: {"type": "string", "maxLength": 12}])(rng)
    low = rng.choice([0, 1, 2])
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.choice([1, 2])}


def _nullable(rng: random.Random) -> Schema:
    return {"anyOf": [rng.choice([_string, _integer])(rng), {"type": "null"}]}


Leaf = Callable[[random.Random], Schema]
LEAVES: list[Leaf] = [
    _string, _pattern, _format, _integer, _number, _boolean, _enum, _array, _nullable,
]  # fmt: skip
SHORT_LEAVES: list[Leaf] = [_pattern, _integer, _boolean, _enum, _array]


def _object(
    rng: random.Random, names: list[str], depth: int, max_fields: int, leaves: list[Leaf]
) -> Schema:
    fields = rng.sample(names, rng.randint(2, min(max_fields, len(names))))
    props: dict[str, Schema] = {}
    for name in fields:
        props[name] = rng.choice(leaves)(rng)
    if depth > 0 and rng.random() < 0.5:
        names = ["id", "score", "tag", "note"]
        props["details"] = _object(rng, names, depth - 1, max_fields, leaves)
    required = [n for n in props if rng.random() < 0.75] or [next(iter(props))]
    return {
        "type": "object", "properties": props, "required": required, "additionalProperties": False,
    }  # fmt: skip


def make_schemas(count: int = 50, small: bool = False) -> list[tuple[str, Schema]]:
    """`count` (prompt, schema) pairs; pair i is the same in every call. `small`: flat objects
    of two or three short fields (answers of ~10-30 tokens, for tests that run many batches)."""
    out = []
    for i in range(count):
        rng = random.Random(i)
        theme, names = THEMES[i % len(THEMES)]
        fields = [*names, "year", "rating", "tags", "status"]
        if small:
            schema = _object(rng, fields, depth=0, max_fields=3, leaves=SHORT_LEAVES)
        else:
            schema = _object(rng, fields, depth=2, max_fields=5, leaves=LEAVES)
        prompt = (
            f"Describe {theme} as a JSON object with the fields {', '.join(schema['properties'])}."
        )
        out.append((prompt, schema))
    return out
