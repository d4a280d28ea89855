"""OpenAI's Responses API: ``POST /v1/responses`` (plain, streamed or in the background), ``GET`` / ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and ``GET /v1/responses/{id}/input_items``.

A request is translated into a chat request (``protocol_responses.py``) and runs exactly as a chat completion
(``ServingChat.prepare`` / ``start``); its output is read back by ``chat_output.py`` and shaped here into
typed output items (``reasoning``, ``message``, ``function_call``) and OpenAI's streaming events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.errors import EngineDeadError
from pagedllm.entrypoints.openai.chat_output import ChoiceDelta, ChoiceResult, ChoiceStream, finish_choice
from pagedllm.entrypoints.openai.chat_request import PreparedChat
from pagedllm.entrypoints.openai.errors import OpenAIError, param_of
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest, to_chat_request
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.serving_chat import ServingChat
from pagedllm.entrypoints.openai.serving_engine import sse, until_disconnect
from pagedllm.entrypoints.streaming import ClosingStreamingResponse
from pagedllm.logger import init_logger
from pagedllm.outputs import RequestOutput
from pagedllm.utils import random_uuid

logger = init_logger(__name__)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{random_uuid().replace('-', '')}"


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as stored: a string input is one user message; every item gets an id."""
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if "id" not in item:
            item["id"] = _new_id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                  "reasoning": "rs"}.get(kind, "item"))
        out.append(item)
    return out


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseShell:
    """The Response object around the output: the request's settings echoed, status, usage."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str) -> None:
        self.req = req
        self.body: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "text": req.text or {"format": {"type": "text"}}, "reasoning": req.reasoning,
            "previous_response_id": req.previous_response_id, "store": req.store, "background": req.background,
            "truncation": "disabled", "user": req.user, "usage": None}

    def snapshot(self, status: str | None = None) -> dict[str, Any]:
        body = dict(self.body)
        if status is not None:
            body["status"] = status
        body["output"] = list(body["output"])
        return body

    def finish(self, output: list[dict[str, Any]], finish_reason: str | None, num_prompt_tokens: int,
               num_output_tokens: int, num_cached_tokens: int, num_reasoning_tokens: int) -> dict[str, Any]:
        if finish_reason == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif finish_reason == "abort":
            status, details = "cancelled", None
        else:
            status, details = "completed", None
        self.body.update(
            status=status, incomplete_details=details, output=output,
            usage={"input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
                   "output_tokens": num_output_tokens,
                   "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
                   "total_tokens": num_prompt_tokens + num_output_tokens})
        if status == "completed":
            self.body["completed_at"] = int(time.time())
        return self.snapshot()


def output_items(result: ChoiceResult, status: str) -> list[dict[str, Any]]:
    """A finished choice as Responses output items: reasoning, then the message, then function calls."""
    items = []
    if result.reasoning is not None:
        items.append(reasoning_item(_new_id("rs"), result.reasoning, status))
    if result.content or not result.calls:
        items.append(message_item(_new_id("msg"), result.content or "", status))
    for call in result.calls:
        items.append(function_call_item(_new_id("fc"), call.id, call.name, call.arguments, status))
    return items


class EventWriter:
    """OpenAI's streaming events for one response, in order, each with the next ``sequence_number``;
    keeps the output items built so far so the final response equals what was streamed."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.open_calls: dict[int, dict[str, Any]] = {}  # tool-call delta index -> its function_call item

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(data)}"

    def _open_item(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.output.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        return events

    def _index(self) -> int:
        return len(self.output) - 1

    def feed(self, delta: ChoiceDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._open_item({"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                           "status": "in_progress"})
                self.open["content"].append({"type": "reasoning_text", "text": ""})
                events.append(self.event("response.content_part.added", item_id=self.open["id"],
                                         output_index=self._index(), content_index=0,
                                         part={"type": "reasoning_text", "text": ""}))
            self.open["content"][0]["text"] += delta.reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=self._index(), content_index=0, delta=delta.reasoning))
        if delta.content:
            events += self.open_message()
            self.open["content"][0]["text"] += delta.content
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=self._index(), content_index=0, delta=delta.content,
                                     logprobs=[]))
        for call in delta.tool_calls:
            if "id" in call:  # a new call: its header
                item = {"id": _new_id("fc"), "type": "function_call", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                events += self._open_item(item)
                self.open_calls[call["index"]] = item
            piece = call["function"].get("arguments", "")
            if piece:
                item = self.open_calls[call["index"]]
                item["arguments"] += piece
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.output.index(item), delta=piece))
        return events

    def open_message(self) -> list[str]:
        """Open a message item with its output_text part, unless one is open."""
        if self.open is not None and self.open["type"] == "message":
            return []
        events = self._open_item({"id": _new_id("msg"), "type": "message", "role": "assistant", "content": [],
                                  "status": "in_progress"})
        self.open["content"].append(output_text_part(""))
        events.append(self.event("response.content_part.added", item_id=self.open["id"],
                                 output_index=self._index(), content_index=0, part=output_text_part("")))
        return events

    def close(self, status: str = "completed") -> list[str]:
        """End the open item with its ``done`` events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.output.index(item)
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(item["content"][0])))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(item["content"][0])))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"], name=item["name"]))
        events.append(self.event("response.output_item.done", output_index=index, item=dict(item)))
        return events


class ServingResponses:
    def __init__(self, chat: ServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self._background: dict[str, asyncio.Task] = {}

    # ---- create ------------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, raw_request: Request):
        model = self.chat.models.check(req.model)
        if req.background and not req.store:
            raise OpenAIError("background: a background response must be stored (store: true)", param="background")
        if req.background and req.stream:
            raise OpenAIError("background: streaming a background response is not supported", param="stream")
        earlier: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = await self.store.get(req.previous_response_id)
            if prev is None:
                raise OpenAIError(f"Previous response with id '{req.previous_response_id}' not found.", 404,
                                  param="previous_response_id")
            if prev.response["status"] in ("queued", "in_progress"):
                raise OpenAIError(f"Previous response '{req.previous_response_id}' has not finished yet.",
                                  param="previous_response_id")
            earlier = prev.context
        input_items = with_ids([{"type": "message", "role": "user", "content": req.input}]
                               if isinstance(req.input, str) else req.input)
        try:
            chat_req = to_chat_request(req, earlier + input_items)
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        prepared = await self.chat.prepare(chat_req)
        shell = ResponseShell(req, model, _new_id("resp"))
        response_id = shell.body["id"]
        context = earlier + input_items
        if req.background:
            shell.body["status"] = "queued"
            await self._store(req, shell.snapshot(), input_items, context)
            task = asyncio.ensure_future(self._run_background(req, prepared, shell, input_items, context))
            self._background[response_id] = task
            task.add_done_callback(lambda _: self._background.pop(response_id, None))
            return JSONResponse(shell.snapshot())
        if req.stream:
            outputs = await self.chat.start(prepared, response_id, stream=True)
            return ClosingStreamingResponse(self._stream(req, prepared, outputs, shell, input_items, context),
                                            on_close=outputs.aclose)

        async def collect() -> dict[str, Any]:
            # The only output is the last: watch for the client leaving from the start (it aborts the request).
            outputs = await self.chat.start(prepared, response_id, stream=False)
            return await self._collect(req, prepared, outputs, shell, input_items, context)

        result = await until_disconnect(raw_request, collect())
        return JSONResponse(result) if result is not None else None

    async def _collect(self, req: ResponsesRequest, prepared: PreparedChat, outputs: AsyncIterator[RequestOutput],
                       shell: ResponseShell, input_items: list[dict[str, Any]],
                       context: list[dict[str, Any]]) -> dict[str, Any]:
        final = None
        async for out in outputs:
            final = out
        assert final is not None and final.finished
        comp = final.outputs[0]
        result = finish_choice(prepared, comp.text, comp.finish_reason)
        status = "incomplete" if comp.finish_reason == "length" else "completed"
        body = shell.finish(output_items(result, status), comp.finish_reason, len(prepared.token_ids),
                            len(comp.token_ids), final.num_cached_tokens, self._count(result.reasoning))
        await self._store(req, body, input_items, context)
        return body

    def _count(self, reasoning: str | None) -> int:
        return len(self.chat.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    async def _store(self, req: ResponsesRequest, body: dict[str, Any], input_items: list[dict[str, Any]],
                     context: list[dict[str, Any]]) -> None:
        if req.store:
            output = [dict(item) for item in body["output"]]
            await self.store.put(body["id"], StoredResponse(body, input_items, context + output))

    # ---- streaming ---------------------------------------------------------------------------------
    async def _stream(self, req: ResponsesRequest, prepared: PreparedChat, outputs: AsyncIterator[RequestOutput],
                      shell: ResponseShell, input_items: list[dict[str, Any]],
                      context: list[dict[str, Any]]) -> AsyncIterator[str]:
        writer = EventWriter(shell)
        yield writer.event("response.created", response=shell.snapshot())
        yield writer.event("response.in_progress", response=shell.snapshot())
        choice = ChoiceStream(prepared)
        num_output_tokens, cached, finish_reason, reasoning = 0, 0, None, ""
        try:
            async for out in outputs:
                cached = out.num_cached_tokens
                comp = out.outputs[0]
                num_output_tokens += len(comp.token_ids)
                delta = choice.feed(comp.text, comp.finish_reason)
                reasoning += delta.reasoning
                for event in writer.feed(delta):
                    yield event
                if comp.finish_reason is not None:
                    finish_reason = comp.finish_reason
        except Exception as e:  # the status line is gone: report in-band, as OpenAI does
            for event in writer.close("incomplete"):
                yield event
            shell.body.update(status="failed", output=writer.output,
                              error={"code": "server_error" if isinstance(e, EngineDeadError) else "invalid_request",
                                     "message": str(e)})
            yield writer.event("response.failed", response=shell.snapshot())
            return
        status = "incomplete" if finish_reason == "length" else "completed"
        if not any(item["type"] != "reasoning" for item in writer.output):
            for event in writer.open_message():  # no answer: still one (empty) message, as a plain response has
                yield event
        for event in writer.close(status):
            yield event
        body = shell.finish(writer.output, finish_reason, len(prepared.token_ids), num_output_tokens, cached,
                            self._count(reasoning or None))
        await self._store(req, body, input_items, context)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(body["status"],
                                                                                          "response.failed")
        yield writer.event(kind, response=body)

    # ---- background --------------------------------------------------------------------------------
    async def _run_background(self, req: ResponsesRequest, prepared: PreparedChat, shell: ResponseShell,
                              input_items: list[dict[str, Any]], context: list[dict[str, Any]]) -> None:
        response_id = shell.body["id"]
        try:
            shell.body["status"] = "in_progress"
            await self._store(req, shell.snapshot(), input_items, context)
            outputs = await self.chat.start(prepared, response_id, stream=False)
            await self._collect(req, prepared, outputs, shell, input_items, context)
        except asyncio.CancelledError:  # cancel(): the engine request was aborted as the stream closed
            shell.body["status"] = "cancelled"
            await self._store(req, shell.snapshot(), input_items, context)
            raise
        except Exception as e:
            logger.warning("background response %s failed: %s", response_id, e)
            shell.body.update(status="failed", error={"code": "server_error", "message": str(e)})
            await self._store(req, shell.snapshot(), input_items, context)

    # ---- stored responses --------------------------------------------------------------------------
    async def _get(self, response_id: str) -> StoredResponse:
        record = await self.store.get(response_id)
        if record is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return record

    async def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse((await self._get(response_id)).response)

    async def delete(self, response_id: str) -> JSONResponse:
        await self._get(response_id)
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
        await self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> JSONResponse:
        record = await self._get(response_id)
        if not record.response.get("background"):
            raise OpenAIError("Only responses created with background: true can be cancelled.", param="response_id")
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            try:
                await task  # its engine request is aborted and the cancelled state stored when this returns
            except asyncio.CancelledError:
                pass
            record = await self._get(response_id)
        elif record.response["status"] not in ("cancelled",):
            raise OpenAIError(f"Response '{response_id}' has already finished ({record.response['status']}) and "
                              "cannot be cancelled.", param="response_id")
        return JSONResponse(record.response)

    async def input_items(self, response_id: str, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> JSONResponse:
        if order not in ("asc", "desc"):
            raise OpenAIError("order: must be 'asc' or 'desc'", param="order")
        if not 1 <= limit <= 100:
            raise OpenAIError("limit: must be between 1 and 100", param="limit")
        items = list((await self._get(response_id)).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise OpenAIError(f"after: no input item with id {after!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
