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
)
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    merge_streams,
    sse,
    stream_error,
    until_disconnect,
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
    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Messages → prompt token ids via the tokenizer's chat template."""
        if not messages:
            raise OpenAIError("messages: must not be empty", param="messages")
        conv = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise OpenAIError("messages: each message needs a string 'role'", param="messages")
            conv.append({**m, "content": _flatten_content(m.get("content"))})
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as e:  # template errors are the client's input problem
            raise OpenAIError(f"messages: could not apply the chat template: {e}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.models.check(req.model)
        token_ids = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                req.chat_template, req.chat_template_kwargs)
        max_tokens = self.check_length(len(token_ids), req.requested_max_tokens(), "messages")
        try:
            params = req.to_sampling_params(max_tokens)
            self.processor.validate_params(params, len(token_ids))
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        request_id = self.make_id("chatcmpl")
        created = int(time.time())
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        merged = merge_streams([self.engine.generate({"prompt_token_ids": token_ids}, params, request_id,
                                                     kind=kind, cache_salt=req.cache_salt)])
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

        if req.stream:
            return StreamingResponse(self._stream(req, len(token_ids), rest(), request_id, model, created),
                                     media_type="text/event-stream")
        result = await until_disconnect(raw_request, self._collect(req, len(token_ids), rest(), request_id,
                                                                   model, created))
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

    async def _collect(self, req: ChatCompletionRequest, num_prompt_tokens: int,
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
            message = ChatMessage(role="assistant", content=comp.text)
            choices.append(ChatChoice(index=comp.index, message=message, logprobs=logprobs,
                                      finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                      usage=self.usage(num_prompt_tokens, completion_tokens,
                                                       final.num_cached_tokens))

    async def _stream(self, req: ChatCompletionRequest, num_prompt_tokens: int,
                      stream: AsyncIterator[RequestOutput], request_id: str, model: str,
                      created: int) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        completion_tokens, cached = 0, 0
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
                    delta = {"content": comp.text} if comp.text or comp.finish_reason is None else {}
                    yield sse({**base, "choices": [{"index": comp.index, "delta": delta, "logprobs": logprobs,
                                                    "finish_reason": comp.finish_reason,
                                                    "stop_reason": comp.stop_reason}]})
            if req.stream_options and req.stream_options.include_usage:
                usage = self.usage(num_prompt_tokens, completion_tokens, cached)
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
        except Exception as e:  # the status line is gone; report in-band
            yield stream_error(e)
        yield sse("[DONE]")
