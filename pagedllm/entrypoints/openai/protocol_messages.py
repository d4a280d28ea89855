"""Request model of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), its
translation into a chat request, and Anthropic's error shape.

Translation only: ``system`` becomes a system message, ``tool_use`` blocks an assistant's ``tool_calls``,
``tool_result`` blocks tool messages, ``tools`` (``input_schema``) chat tools, ``tool_choice`` (auto / any /
tool / none) chat's, ``stop_sequences`` ``stop``; ``chat_request.py`` builds the prompt and parameters.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIModel

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` (Anthropic's shape)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesCountRequest(OpenAIModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(MessagesCountRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}, "effort"}


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ValueError(f"{where}: must be a string or a list of content blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ValueError(f"{where}.{j}.type: only text blocks are supported here, got {kind!r}")
        texts.append(block["text"])
    return "".join(texts)


def _chat_messages(req: MessagesCountRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    tool_ids: set[str] = set()
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role: must be 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content: must be a string or a list of content blocks")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input"), dict):
                    raise ValueError(f"{at}: a tool_use block needs a string id and name and an object input")
                tool_ids.add(block["id"])
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and role == "user":
                if block.get("tool_use_id") not in tool_ids:
                    raise ValueError(f"{at}.tool_use_id: no tool_use with id {block.get('tool_use_id')!r} "
                                     "comes before it")
                result = block.get("content", "")
                text = _text(result, f"{at}.content")
                messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                 "content": f"Error: {text}" if block.get("is_error") else text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier thinking is not shown to the model again
            else:
                raise ValueError(f"{at}.type: {kind!r} blocks are not supported in a {role} message")
        if texts or calls or not content:
            entry: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (
                None, "custom"):
            raise ValueError(f"tools.{i}: only custom tools with a name and an input_schema are supported")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise ValueError(f"tools.{i}.input_schema: must be a JSON schema object")
        fn = {"name": tool["name"], "parameters": schema}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice.name: is required for type 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValueError(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")


def _output_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """``output_config.format`` (a JSON schema) -> ``response_format``; ``effort`` -> the chat template."""
    if not config:
        return {}
    out: dict[str, Any] = {}
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ValueError("output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if config.get("effort") is not None:
        out["chat_template_kwargs"] = {"reasoning_effort": config["effort"]}
    return out


def to_chat_request(req: MessagesCountRequest) -> ChatCompletionRequest:
    choice, parallel = _chat_tool_choice(req.tool_choice)
    tools = _chat_tools(req.tools)
    if tools is None and choice == "none":
        choice = None
    budget = None
    if req.thinking and req.thinking.get("type") == "enabled":
        budget = req.thinking.get("budget_tokens")
    kwargs: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        kwargs = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stop=req.stop_sequences, thinking_token_budget=budget, **_output_config(req.output_config))
    return ChatCompletionRequest(model=req.model, messages=_chat_messages(req), tools=tools, tool_choice=choice,
                                 parallel_tool_calls=parallel, **kwargs)
