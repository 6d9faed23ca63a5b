"""JSON schemas for structured-output tests and the benchmark: nested objects, enums, arrays, bounded
strings and numbers (the bundled model writes Shakespeare into any string, so strings carry maxLength
for the completions to end inside a small max_tokens)."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "mood": {"enum": ["happy", "sad", "angry"]},
        },
        "required": ["name", "age", "mood"], "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "speaker": {"type": "string", "maxLength": 10},
            "home": {"type": "object", "properties": {
                "city": {"enum": ["Verona", "Mantua", "Padua"]},
                "walls": {"type": "boolean"},
                "gate": {"type": "object", "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 9}},
                         "required": ["number"], "additionalProperties": False},
            }, "required": ["city", "walls", "gate"], "additionalProperties": False},
        },
        "required": ["speaker", "home"], "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "lines": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "maxItems": 4},
            "acts": {"type": "array", "items": {"enum": ["I", "II", "III", "IV", "V"]}, "minItems": 2, "maxItems": 2},
        },
        "required": ["lines", "scores", "acts"], "additionalProperties": False,
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "send_letter"]},
            "arguments": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 10},
                "urgent": {"type": "boolean"},
                "recipients": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
            }, "required": ["city", "urgent", "recipients"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    },
}

REGEXES: dict[str, str] = {
    "date": r"\d{4}-(0[1-9]|1[0-2])-\d{2}",
    "name_and_number": r"[A-Z][a-z]{1,8} [0-9]{2}",
}
