"""``POST /v1/chat/completions``: messages through the chat template, role/content deltas, chat logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.errors import OpenAIError, param_of
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobToken,
    ChatMessage,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    merge_streams,
    sse,
    stream_error,
    until_disconnect,
)
from pagedllm.entrypoints.openai.tool_parsers import ParsedCall, ToolParser, get_tool_parser, parser_for_template
from pagedllm.entrypoints.openai.tools import (
    TOOL_CHATML_TEMPLATE,
    ToolPlan,
    calls_from_constrained_output,
    new_call_id,
    plan_tools,
    template_has_tools,
    tool_call_streamer,
)
from pagedllm.outputs import Logprob, RequestOutput


def _flatten_content(content: Any) -> str:
    """OpenAI allows content as a string or a list of parts; we take the text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise OpenAIError("messages: only text content parts are supported", param="messages")
        return "\n".join(texts)
    raise OpenAIError("messages: content must be a string or a list of text parts", param="messages")


class ServingChat(OpenAIServing):
    tool_parser: ToolParser = get_tool_parser("hermes")

    def configure_tools(self, tool_call_parser: str | None = None) -> None:
        """``tool_choice: auto`` parses with ``tool_call_parser``, or (None) the parser matching the model's
        chat template."""
        if tool_call_parser is None:
            tool_call_parser = parser_for_template(getattr(self.tokenizer, "chat_template", None))
        self.tool_parser = get_tool_parser(tool_call_parser)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Messages → prompt token ids via the tokenizer's chat template."""
        if not messages:
            raise OpenAIError("messages: must not be empty", param="messages")
        conv = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise OpenAIError("messages: each message needs a string 'role'", param="messages")
            conv.append({**m, "content": _flatten_content(m.get("content"))})
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in conv)
        if uses_tools and chat_template is None and not template_has_tools(self.tokenizer.chat_template):
            chat_template = TOOL_CHATML_TEMPLATE  # the model's template would drop the tools silently
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **extra)
        except Exception as e:  # template errors are the client's input problem
            raise OpenAIError(f"messages: could not apply the chat template: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.models.check(req.model)
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        token_ids = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template, req.chat_template_kwargs, plan.tools or None)
        max_tokens = self.check_length(len(token_ids), req.requested_max_tokens(), "messages")
        try:
            params = req.to_sampling_params(max_tokens)
            if plan.constraint is not None:
                if params.structured_outputs is not None:
                    raise ValueError("tool_choice: a named or required tool choice cannot be combined with "
                                     "response_format or structured_outputs")
                params.structured_outputs = plan.constraint
            self.processor.validate_params(params, len(token_ids))
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        request_id = self.make_id("chatcmpl")
        created = int(time.time())
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        merged = merge_streams([self.engine.generate({"prompt_token_ids": token_ids}, params, request_id,
                                                     kind=kind, cache_salt=req.cache_salt,
                                                     lora_request=self.models.adapter(model))])

        async def outputs() -> AsyncIterator[RequestOutput]:
            """The request's outputs, the first awaited here so that a refused request is a 400."""
            try:
                first = await merged.__anext__()
            except ValueError as e:
                raise OpenAIError(str(e), param=param_of(str(e))) from None

            async def rest() -> AsyncIterator[RequestOutput]:
                try:
                    yield first[1]
                    async for _, item in merged:
                        yield item
                finally:
                    await merged.aclose()

            return rest()

        if req.stream:
            return StreamingResponse(self._stream(req, plan, len(token_ids), await outputs(), request_id, model,
                                                  created), media_type="text/event-stream")

        async def collect() -> ChatCompletionResponse:
            # A non-streamed request's first output is its last: watch for the client leaving from the start.
            return await self._collect(req, plan, len(token_ids), await outputs(), request_id, model, created)

        result = await until_disconnect(raw_request, collect())
        return JSONResponse(result.model_dump()) if result is not None else None

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]],
                  k: int) -> ChatChoiceLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            lp = entry.get(token_id)
            token = self.token_str(token_id, lp)
            top = [ChatLogprob(token=(s := self.token_str(t, v)), logprob=v.logprob, bytes=list(s.encode()))
                   for t, v in self.top_entries(entry, k)]
            content.append(ChatLogprobToken(token=token, logprob=lp.logprob if lp else float("-inf"),
                                            bytes=list(token.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def _tool_calls(self, plan: ToolPlan, text: str, finish_reason: str | None
                    ) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished choice; no calls unless the output ended by itself."""
        if plan.mode in ("named", "required"):
            if finish_reason != "stop":
                return text, []  # cut short (length/abort): the arguments are incomplete JSON
            return None, calls_from_constrained_output(plan, text)
        if plan.mode == "auto":
            return self.tool_parser.parse(text)
        return text, []

    async def _collect(self, req: ChatCompletionRequest, plan: ToolPlan, num_prompt_tokens: int,
                       stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                       created: int) -> ChatCompletionResponse:
        final = None
        async for out in stream:
            final = out
        assert final is not None and final.finished
        choices = []
        for comp in final.outputs:
            logprobs = (self._logprobs(comp.token_ids, comp.logprobs or [], req.top_logprobs or 0)
                        if req.logprobs else None)
            content, calls = self._tool_calls(plan, comp.text, comp.finish_reason)
            tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                          for c in calls]
            message = ChatMessage(role="assistant", content=content, tool_calls=tool_calls)
            finish_reason = "tool_calls" if tool_calls else comp.finish_reason
            choices.append(ChatChoice(index=comp.index, message=message, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=comp.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=self.usage(num_prompt_tokens, completion_tokens,
                                                       final.num_cached_tokens),
                                      kv_transfer_params=final.kv_transfer_params)

    def _tool_deltas(self, plan: ToolPlan, state: dict[str, Any], text: str, finish_reason: str | None
                     ) -> tuple[str, list[dict[str, Any]], str | None]:
        """Streaming with tools, for one choice: (content to send now, tool-call deltas, finish_reason).

        A call goes out as soon as its name and the start of its arguments are generated (a delta with its
        id and name), then its arguments piece by piece as they grow (``tool_call_stream.py``). In ``auto``
        mode content streams up to where a call may start; a call the parser finds only in the finished
        text (no arguments key, say) goes out whole at the end.
        """
        state["text"] += text
        full = state["text"]
        streamer = state.setdefault("streamer", tool_call_streamer(plan, self.tool_parser))
        deltas = streamer.feed(full)
        if plan.mode != "auto":
            if finish_reason is None:
                return "", deltas, None
            if streamer.started:  # cut short (length): the partial call stays, as OpenAI streams it
                return "", deltas, "tool_calls" if finish_reason == "stop" else finish_reason
            return full, deltas, finish_reason
        if finish_reason is None:
            safe = self.tool_parser.safe_prefix_len(full)
            out, state["sent"] = full[state["sent"]:max(safe, state["sent"])], max(safe, state["sent"])
            return out, deltas, None
        content, calls = self._tool_calls(plan, full, finish_reason)
        if not calls and not streamer.started:
            out, state["sent"] = full[state["sent"]:], len(full)
            return out, deltas, finish_reason
        rest = (content or "")[state["sent"]:] if content else ""
        for i, call in enumerate(calls[len(streamer.sent):], start=len(streamer.sent)):
            deltas.append({"index": i, "id": new_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return rest, deltas, "tool_calls"

    async def _stream(self, req: ChatCompletionRequest, plan: ToolPlan, num_prompt_tokens: int,
                      stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                      created: int) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        completion_tokens, cached = 0, 0
        tool_states: dict[int, dict[str, Any]] = {}
        try:
            # The role comes first, in its own delta per choice, as OpenAI sends it.
            for i in range(req.n):
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            async for out in stream:
                cached = out.num_cached_tokens
                for comp in out.outputs:
                    completion_tokens += len(comp.token_ids)
                    if not comp.text and comp.finish_reason is None and not comp.token_ids:
                        continue
                    logprobs = None
                    if req.logprobs:
                        logprobs = self._logprobs(comp.token_ids, comp.logprobs or [],
                                                  req.top_logprobs or 0).model_dump()
                    text, finish_reason, tool_deltas = comp.text, comp.finish_reason, []
                    if plan.mode != "none":
                        state = tool_states.setdefault(comp.index, {"text": "", "sent": 0})
                        text, tool_deltas, finish_reason = self._tool_deltas(plan, state, comp.text,
                                                                             comp.finish_reason)
                    for tool_delta in tool_deltas:
                        yield sse({**base, "choices": [{"index": comp.index, "delta": {"tool_calls": [tool_delta]},
                                                        "logprobs": None, "finish_reason": None}]})
                    if not text and finish_reason is None and (tool_deltas or plan.mode != "none"):
                        continue  # held back: nothing to send yet
                    delta = {"content": text} if text or finish_reason is None else {}
                    yield sse({**base, "choices": [{"index": comp.index, "delta": delta, "logprobs": logprobs,
                                                    "finish_reason": finish_reason,
                                                    "stop_reason": comp.stop_reason}]})
            if req.stream_options and req.stream_options.include_usage:
                usage = self.usage(num_prompt_tokens, completion_tokens, cached)
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
        except Exception as e:  # the status line is gone; report in-band
            yield stream_error(e)
        yield sse("[DONE]")
