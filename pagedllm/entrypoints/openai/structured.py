"""The API's structured-output fields -> ``StructuredOutputsParams``; fields we do not support -> 400.

OpenAI: ``response_format`` = {"type": "text"} | {"type": "json_object"} |
{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
vLLM: ``structured_outputs`` = {"json" | "regex" | "choice" | "grammar" | "json_object": ...}.
"""

from __future__ import annotations

from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams

# Fields other servers accept that would change what the output must be. The request models ignore unknown
# fields (clients send newer ones), but silently ignoring these would answer with unconstrained text.
UNSUPPORTED_FIELDS = {
    "guided_json": "use structured_outputs.json or response_format",
    "guided_regex": "use structured_outputs.regex",
    "guided_choice": "use structured_outputs.choice",
    "guided_grammar": "use structured_outputs.grammar",
    "guided_decoding_backend": "the backend is xgrammar",
    "guided_whitespace_pattern": "not supported",
    "structural_tag": "not supported",
    "functions": "use tools",
    "function_call": "use tool_choice",
    "logits_processors": "not supported",
}

_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def reject_unsupported_fields(data: Any) -> Any:
    """A pydantic 'before' validator: a ValueError naming the first unsupported field that is set."""
    if isinstance(data, dict):
        for name, hint in UNSUPPORTED_FIELDS.items():
            if data.get(name) is not None:
                raise ValueError(f"{name}: is not supported by this server ({hint})")
    return data


def structured_outputs_from_request(response_format: dict[str, Any] | None,
                                    structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """Raises ValueError naming the field (response_format.* / structured_outputs.*)."""
    from_format = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is not None:
        if from_format is not None:
            raise ValueError("structured_outputs: cannot be combined with a response_format other than text")
        return StructuredOutputsParams.from_dict(structured_outputs)
    return from_format


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise ValueError("response_format: must be an object")
    kind = fmt.get("type")
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"response_format.{extra[0]}: is not supported")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: must be an object with a 'schema'")
        unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise ValueError(f"response_format.json_schema.{unknown[0]}: is not supported")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
        if spec.get("strict") not in (None, True, False):
            raise ValueError("response_format.json_schema.strict: must be a boolean")
        # strict or not, the output is held to the schema (the grammar enforces it either way).
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")
