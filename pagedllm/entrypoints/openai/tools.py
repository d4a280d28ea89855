"""Tool calling on chat completions: validate ``tools``/``tool_choice``, turn named/required choices into a
JSON-schema grammar (so arguments always validate), and turn the finished text into ``tool_calls``.

- ``none``: tools are shown to the template, the output is plain text.
- ``auto`` (also what ``tools`` without ``tool_choice`` means, as in OpenAI's API): free text, parsed by the
  parser matching the model's chat template (``--tool-call-parser`` picks another).
- ``required``: the output is a JSON array of ``{"name", "parameters"}``, one schema branch per function.
- named ``{"type": "function", "function": {"name": ...}}``: the output is that function's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_call_stream import ToolCallStreamer, final_calls, scan_named, scan_required
from pagedllm.entrypoints.openai.tool_parsers import ParsedCall, ToolParser
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.utils import random_uuid

# Used when the model's own chat template knows nothing of tools (the default SmolLM2 is plain ChatML):
# ChatML with the tools in the system turn, Hermes-style <tool_call> blocks, tool results as user turns.
TOOL_CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call one or more functions to assist with the user query. The function signatures are '"
    "'within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a JSON object with the function name and arguments '"
    "'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    "'<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- set args = call.function.arguments %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- args if args is string else (args | tojson) }}"
    "{{- '}\\n</tool_call>' + ('\\n' if not loop.last else '') }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class ToolPlan:
    """What a chat request's tools mean for this request."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]
    named: str | None = None
    constraint: StructuredOutputsParams | None = None


def _function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools: must be a non-empty list")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools.{i}.type: only 'function' tools are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools.{i}.function.name: is required")
        if fn["name"] in names:
            raise ValueError(f"tools.{i}.function.name: {fn['name']!r} appears twice")
        names.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools.{i}.function.parameters: must be a JSON schema object")
    return tools


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """Raises ValueError naming the field for anything inconsistent."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: requires tools")
        return ToolPlan("none", [])
    tools = validate_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        # Always on (vLLM needs --enable-auto-tool-choice; OpenAI does not): the openai client's ordinary
        # tool loop sends tools without tool_choice, which must not be a 400.
        return ToolPlan("auto", tools)
    if choice == "required":
        branches = [{"type": "object",
                     "properties": {"name": {"const": t["function"]["name"]}, "parameters": _function_schema(t)},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=schema))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
        return ToolPlan("named", tools, named=name,
                        constraint=StructuredOutputsParams(json=_function_schema(match[0])))
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {choice!r}")


def new_call_id() -> str:
    return f"call_{random_uuid()[:24]}"


def calls_from_constrained_output(plan: ToolPlan, text: str) -> list[ParsedCall]:
    """The grammar-constrained output of a named/required request -> its calls (ValueError if cut short).

    Arguments are the exact text generated, so they equal the concatenated deltas of a stream."""
    if plan.mode == "named":
        assert plan.named is not None
        return final_calls(scan_named(text), text, named=plan.named)
    json.loads(text)  # the whole array must be complete JSON
    return final_calls(scan_required(text), text)


def tool_call_streamer(plan: ToolPlan, parser: ToolParser) -> ToolCallStreamer:
    """The streamer that finds this plan's calls in a growing completion."""
    if plan.mode == "named":
        return ToolCallStreamer(scan_named, new_call_id, named=plan.named)
    if plan.mode == "required":
        return ToolCallStreamer(scan_required, new_call_id)
    return ToolCallStreamer(parser.scan, new_call_id)


def template_has_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template
