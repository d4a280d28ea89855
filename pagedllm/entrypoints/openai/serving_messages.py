"""Anthropic's Messages API: ``POST /v1/messages`` (plain or streamed with Anthropic's events) and
``POST /v1/messages/count_tokens``.

A request is translated into a chat request (``protocol_messages.py``) and runs exactly as a chat completion
(``ServingChat.prepare`` / ``start``); its output is read back by ``chat_output.py`` and shaped here into
``thinking``, ``text`` and ``tool_use`` content blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.errors import EngineDeadError
from pagedllm.entrypoints.openai.chat_output import ChoiceDelta, ChoiceStream, finish_choice
from pagedllm.entrypoints.openai.chat_request import PreparedChat
from pagedllm.entrypoints.openai.errors import OpenAIError, param_of
from pagedllm.entrypoints.openai.protocol_messages import (
    MessagesCountRequest,
    MessagesRequest,
    anthropic_error_body,
    to_chat_request,
)
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_engine import until_disconnect
from pagedllm.entrypoints.streaming import ClosingStreamingResponse
from pagedllm.outputs import RequestOutput
from pagedllm.utils import random_uuid


def _stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) of a finished choice."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class ServingMessages:
    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat

    async def _prepare(self, req: MessagesCountRequest) -> PreparedChat:
        self.chat.models.check(req.model)
        try:
            chat_req = to_chat_request(req)
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        return await self.chat.prepare(chat_req)

    async def count_tokens(self, req: MessagesCountRequest) -> JSONResponse:
        """The prompt's length as ``create`` would build it (no generation)."""
        self.chat.models.check(req.model)
        try:
            chat_req = to_chat_request(req)
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        ids = self.chat.converter.render(chat_req.messages, tools=chat_req.tools)
        return JSONResponse({"input_tokens": len(ids)})

    async def create(self, req: MessagesRequest, raw_request: Request):
        if req.max_tokens < 1:
            raise OpenAIError("max_tokens: must be at least 1", param="max_tokens")
        model = self.chat.models.check(req.model)
        prepared = await self._prepare(req)
        message_id = f"msg_{random_uuid().replace('-', '')}"
        if req.stream:
            outputs = await self.chat.start(prepared, message_id, stream=True)
            return ClosingStreamingResponse(self._stream(prepared, outputs, message_id, model), on_close=outputs.aclose)

        async def collect() -> dict[str, Any]:
            # The only output is the last: watch for the client leaving from the start (it aborts the request).
            outputs = await self.chat.start(prepared, message_id, stream=False)
            final = None
            async for out in outputs:
                final = out
            assert final is not None and final.finished
            comp = final.outputs[0]
            result = finish_choice(prepared, comp.text, comp.finish_reason)
            content: list[dict[str, Any]] = []
            if result.reasoning is not None:
                content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
            if result.content:
                content.append({"type": "text", "text": result.content})
            for call in result.calls:
                content.append({"type": "tool_use", "id": call.id, "name": call.name,
                                "input": json.loads(call.arguments)})
            stop_reason, stop_sequence = _stop_reason(result.finish_reason, comp.stop_reason)
            return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
                    "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                    "usage": {"input_tokens": len(prepared.token_ids), "output_tokens": len(comp.token_ids),
                              "cache_read_input_tokens": final.num_cached_tokens}}

        result = await until_disconnect(raw_request, collect())
        return JSONResponse(result) if result is not None else None

    async def _stream(self, prepared: PreparedChat, outputs: AsyncIterator[RequestOutput], message_id: str,
                      model: str) -> AsyncIterator[str]:
        yield _event("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(prepared.token_ids), "output_tokens": 0}}})
        blocks = BlockWriter()
        choice = ChoiceStream(prepared)
        num_output_tokens, finish_reason, matched = 0, None, None
        try:
            async for out in outputs:
                comp = out.outputs[0]
                num_output_tokens += len(comp.token_ids)
                delta = choice.feed(comp.text, comp.finish_reason)
                for event in blocks.feed(delta):
                    yield event
                if delta.finish_reason is not None:
                    finish_reason, matched = delta.finish_reason, comp.stop_reason
        except Exception as e:  # the status line is gone: an error event, as Anthropic sends one
            status = 503 if isinstance(e, EngineDeadError) else 400 if isinstance(e, ValueError) else 500
            yield _event("error", {"error": anthropic_error_body(str(e), status)["error"]})
            return
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop_reason(finish_reason, matched)
        yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": num_output_tokens}})
        yield _event("message_stop", {})


class BlockWriter:
    """Anthropic's content-block events: one block open at a time, indexes in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.calls: dict[int, int] = {}  # tool-call delta index -> block index

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def feed(self, delta: ChoiceDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "thinking_delta", "thinking": delta.reasoning}}))
        if delta.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": delta.content}}))
        for call in delta.tool_calls:
            if "id" in call:
                events += self._start("tool_use", {"type": "tool_use", "id": call["id"],
                                                   "name": call["function"]["name"], "input": {}})
                self.calls[call["index"]] = self.index
            piece = call["function"].get("arguments", "")
            if piece:
                events.append(_event("content_block_delta", {"index": self.calls[call["index"]], "delta": {
                    "type": "input_json_delta", "partial_json": piece}}))
        return events
