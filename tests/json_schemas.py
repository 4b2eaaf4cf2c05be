"""Twenty JSON schemas for the structured output tests: nested objects, enums, arrays with
minItems / maxItems, required properties, bounded numbers, string patterns and lengths. Every
answer is bounded (integers too: a small model left free counts digits until max_tokens), so a
model that follows the grammar finishes within a few dozen tokens."""
from __future__ import annotations

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}}, "required": ["ok", "n"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9},
                                             "minItems": 2, "maxItems": 4}}, "required": ["xs"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 100}},
                                            "required": ["q"]}}, "required": ["p"]},
    {"type": "object", "properties": {"v": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["v"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["id"]},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"k": {"type": "integer", "minimum": 10, "maximum": 99},
                                      "s": {"type": "string", "maxLength": 3}}, "required": ["k", "s"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"const": {"const": "fixed"}}, "required": ["const"]},
    {"type": "object", "properties": {"u": {"anyOf": [{"type": "integer", "maximum": 50}, {"type": "boolean"}]}},
     "required": ["u"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "string", "maxLength": 8},
    {"type": "integer", "minimum": -100, "maximum": 100},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "high"]}, "score": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 3}},
     "required": ["level", "score"]},
    {"type": "array", "items": {"type": "object", "properties": {"i": {"type": "integer", "minimum": 0,
                                                                       "maximum": 5}},
                                "required": ["i"]}, "minItems": 1, "maxItems": 2},
]
