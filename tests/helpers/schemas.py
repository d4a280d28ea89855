"""JSON schemas the structured-output tests sample against: nested objects, arrays, enums, bounded numbers
and patterns. Bounded lengths keep a small model's completions short enough to end by themselves."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["apple", "pear", "plum"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
        "price": {"type": "number", "minimum": 0, "maximum": 100},
        "rush": {"type": "boolean"},
    },
    "required": ["item", "quantity", "rush"],
    "additionalProperties": False,
}

NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,9}$"},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                           "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["big", "old", "new"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "location", "tags"],
    "additionalProperties": False,
}

SCHEMAS = {"person": PERSON, "order": ORDER, "nested": NESTED}

PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"
