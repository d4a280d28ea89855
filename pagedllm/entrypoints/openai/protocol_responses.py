"""Request model of OpenAI's Responses API (``POST /v1/responses``) and its translation into a chat request.

Translation only: items become chat messages, flat function tools become chat tools, ``text.format`` becomes
``response_format``; ``chat_request.py`` then builds the prompt and sampling parameters as for any chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIModel
from pagedllm.entrypoints.openai.structured import reject_unsupported_fields

# Fields of OpenAI's request that would change the output and that this server does not implement.
_UNSUPPORTED = ("conversation", "prompt", "max_tool_calls", "top_logprobs")


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    # vLLM extras
    seed: int | None = None
    top_k: int | None = None
    thinking_token_budget: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0

    @model_validator(mode="before")
    @classmethod
    def _check_unsupported(cls, data: Any) -> Any:
        reject_unsupported_fields(data)
        if isinstance(data, dict):
            for name in _UNSUPPORTED:
                if data.get(name) is not None:
                    raise ValueError(f"{name}: is not supported by this server")
        return data


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools -> chat tools (``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ValueError(f"tools.{i}.type: only 'function' tools are supported, got {kind!r}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools.{i}.name: is required")
        fn = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``{"type": "function", "name": ...}`` -> chat's ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice: a named choice is {\"type\": \"function\", \"name\": ...}")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` -> chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError("text.format: must be an object")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        if not isinstance(spec.get("schema"), dict):
            raise ValueError("text.format.schema: must be a JSON schema object")
        return {"type": "json_schema", "json_schema": spec}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise ValueError(f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}")


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts (input_text / output_text / text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise ValueError(f"{where}.content.{j}: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}.content: must be a string or a list of text parts")


def messages_from_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items (earlier ones first) -> chat messages. Consecutive function calls become one
    assistant message's ``tool_calls``; a ``function_call_output`` must answer a call made before it."""
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ValueError(f"{where}.role: must be system, developer, user or assistant, got {role!r}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call needs string call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and ("tool_calls" in last or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]  # the text that came with the call, then the call
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            call_ids.add(item["call_id"])
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in call_ids:
                raise ValueError(f"{where}.call_id: no function_call with call_id {call_id!r} comes before it")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again (chat templates drop it too)
        else:
            raise ValueError(f"{where}.type: {kind!r} items are not supported "
                             "(message, function_call, function_call_output, reasoning)")
    return messages


def to_chat_request(req: ResponsesRequest, context: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request equivalent to ``req`` over ``context`` (earlier items, then this input's)."""
    messages = messages_from_items(context)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    kwargs: dict[str, Any] = {}
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        kwargs["chat_template_kwargs"] = {"reasoning_effort": effort}  # for templates that read it
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k, user=req.user,
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=chat_response_format(req.text),
        thinking_token_budget=req.thinking_token_budget, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        **kwargs)
