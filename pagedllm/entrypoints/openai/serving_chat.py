"""``POST /v1/chat/completions``: messages through the chat template, role/content deltas, chat logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.chat_output import ChoiceStream, finish_choice
from pagedllm.entrypoints.openai.chat_request import ChatConverter, PreparedChat
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
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    merge_streams,
    sse,
    stream_error,
    until_disconnect,
)
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser, parser_for_template
from pagedllm.entrypoints.streaming import ClosingStreamingResponse
from pagedllm.outputs import Logprob, RequestOutput


class ServingChat(OpenAIServing):
    """Chat completions; also the engine side (prepare, start) the Responses and Messages endpoints share."""

    tool_parser: ToolParser = get_tool_parser("hermes")
    reasoning_parser: ReasoningParser | None = None

    def configure_tools(self, tool_call_parser: str | None = None) -> None:
        """``tool_choice: auto`` parses with ``tool_call_parser``, or (None) the parser matching the model's
        chat template."""
        if tool_call_parser is None:
            tool_call_parser = parser_for_template(getattr(self.tokenizer, "chat_template", None))
        self.tool_parser = get_tool_parser(tool_call_parser)

    def configure_reasoning(self, reasoning_parser: str | None) -> None:
        """``--reasoning-parser``: split the thinking off the answer (None: the output is all answer)."""
        self.reasoning_parser = get_reasoning_parser(reasoning_parser)

    @property
    def converter(self) -> ChatConverter:
        return ChatConverter(self.tokenizer, self.processor, self.check_length, self.tool_parser,
                             self.reasoning_parser)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Messages → prompt token ids via the tokenizer's chat template (``/tokenize``)."""
        return self.converter.render(messages, add_generation_prompt)

    async def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        """The engine request of a chat-shaped request (every endpoint's), with the LoRA adapter its ``model``
        names (None: the base model)."""
        prepared = await self.converter.prepare(req)
        prepared.lora_request = self.models.adapter(req.model)
        return prepared

    async def start(self, prepared: PreparedChat, request_id: str, stream: bool) -> AsyncIterator[RequestOutput]:
        """Submit to the engine; the outputs, the first awaited here so that a refused request is a 400.
        Closing the iterator aborts the request (its KV blocks are freed)."""
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        merged = merge_streams([self.engine.generate(prepared.prompt, prepared.params, request_id, kind=kind,
                                                     cache_salt=prepared.cache_salt,
                                                     lora_request=prepared.lora_request)])
        try:
            first = await merged.__anext__()
        except ValueError as e:
            await merged.aclose()
            raise OpenAIError(str(e), param=param_of(str(e))) from None

        async def rest() -> AsyncIterator[RequestOutput]:
            try:
                yield first[1]
                async for _, item in merged:
                    yield item
            finally:
                await merged.aclose()

        return rest()

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.models.check(req.model)
        prepared = await self.prepare(req)
        request_id = self.make_id("chatcmpl")
        created = int(time.time())
        if req.stream:
            outputs = await self.start(prepared, request_id, stream=True)
            return ClosingStreamingResponse(self._stream(req, prepared, outputs, request_id, model, created),
                                            on_close=outputs.aclose)

        async def collect() -> ChatCompletionResponse:
            # A non-streamed request's first output is its last: watch for the client leaving from the start.
            outputs = await self.start(prepared, request_id, stream=False)
            return await self._collect(req, prepared, outputs, request_id, model, created)

        result = await until_disconnect(raw_request, collect())
        return JSONResponse(result.model_dump(exclude_none=False)) if result is not None else None

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

    async def _collect(self, req: ChatCompletionRequest, prepared: PreparedChat,
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
            result = finish_choice(prepared, comp.text, comp.finish_reason)
            tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                          for c in result.calls]
            message = ChatMessage(role="assistant", content=result.content, tool_calls=tool_calls,
                                  reasoning=result.reasoning, reasoning_content=result.reasoning)
            choices.append(ChatChoice(index=comp.index, message=message, logprobs=logprobs,
                                      finish_reason=result.finish_reason, stop_reason=comp.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=self.usage(len(prepared.token_ids), completion_tokens,
                                                       final.num_cached_tokens),
                                      kv_transfer_params=final.kv_transfer_params)

    async def _stream(self, req: ChatCompletionRequest, prepared: PreparedChat,
                      stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                      created: int) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        completion_tokens, cached = 0, 0
        choice_streams: dict[int, ChoiceStream] = {}
        quiet = prepared.plan.mode != "none" or prepared.reasoning_parser is not None  # may hold text back

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None,
                  **extra: Any) -> str:
            return sse({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                             "finish_reason": finish_reason, **extra}]})

        try:
            # The role comes first, in its own delta per choice, as OpenAI sends it.
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
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
                    choice = choice_streams.setdefault(comp.index, ChoiceStream(prepared))
                    delta = choice.feed(comp.text, comp.finish_reason)
                    if delta.reasoning:
                        yield chunk(comp.index, {"reasoning": delta.reasoning, "reasoning_content": delta.reasoning})
                    for tool_delta in delta.tool_calls:
                        yield chunk(comp.index, {"tool_calls": [tool_delta]})
                    text, finish_reason = delta.content, delta.finish_reason
                    if not text and finish_reason is None and (delta.tool_calls or delta.reasoning or quiet):
                        continue  # held back, or sent above: nothing more to send yet
                    yield chunk(comp.index, {"content": text} if text or finish_reason is None else {}, logprobs,
                                finish_reason, stop_reason=comp.stop_reason)
            if req.stream_options and req.stream_options.include_usage:
                usage = self.usage(len(prepared.token_ids), completion_tokens, cached)
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
        except Exception as e:  # the status line is gone; report in-band
            yield stream_error(e)
        yield sse("[DONE]")
