"""``POST /v1/completions``: prompts (text, texts, token ids) → text, with echo, logprobs and streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.errors import OpenAIError, param_of
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    sse,
    start_streams,
    stream_error,
    until_disconnect,
)
from pagedllm.entrypoints.streaming import ClosingStreamingResponse
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


class _Prompt:
    def __init__(self, text: str, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids


class ServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> list[_Prompt]:
        raw = req.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise OpenAIError("prompt: must not be empty", param="prompt")
        prompts = []
        for item in raw:
            try:
                text, ids = self.processor.tokenize(item, req.add_special_tokens)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt") from None
            prompts.append(_Prompt(text if text is not None else self.tokenizer.decode(ids), ids))
        return prompts

    def _params(self, req: CompletionRequest, prompts: list[_Prompt]) -> SamplingParams:
        if req.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of: only best_of == n is supported", param="best_of")
        for p in prompts:
            self.check_length(len(p.token_ids), req.max_tokens, "prompt")
        try:
            params = req.to_sampling_params(req.max_tokens)
            for p in prompts:
                self.processor.validate_params(params, len(p.token_ids))
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        return params

    async def create(self, req: CompletionRequest, raw_request: Request):
        model = self.models.check(req.model)
        prompts = self._prompts(req)
        params = self._params(req, prompts)
        request_id = self.make_id("cmpl")
        created = int(time.time())
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        streams = [self.engine.generate({"prompt_token_ids": p.token_ids}, params, f"{request_id}-{i}",
                                        kind=kind, cache_salt=req.cache_salt, arrival_time=time.time(),
                                        lora_request=self.models.adapter(model))
                   for i, p in enumerate(prompts)]
        if req.stream:
            outputs = await start_streams(streams)
            return ClosingStreamingResponse(self._stream(req, prompts, outputs, request_id, model, created),
                                            on_close=outputs.aclose)

        async def collect() -> CompletionResponse:
            # A non-streamed request's first output is its last: watch for the client leaving from the start.
            return await self._collect(req, prompts, await start_streams(streams), request_id, model, created)

        result = await until_disconnect(raw_request, collect())
        return JSONResponse(result.model_dump()) if result is not None else None

    # ---- logprobs -----------------------------------------------------------------------------------------
    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int,
                  offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries, strict=False):
            lp = entry.get(token_id) if entry else None
            token = self.token_str(token_id, lp)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob if lp else None)
            if entry is None:
                out.top_logprobs.append(None)
            else:
                top = {self.token_str(t, v): v.logprob for t, v in self.top_entries(entry, k)}
                if lp is not None:
                    top.setdefault(token, lp.logprob)
                out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _echo_logprobs(self, req: CompletionRequest, out: RequestOutput,
                       prompt: _Prompt) -> CompletionLogprobs:
        entries = list(out.prompt_logprobs or [None] * len(prompt.token_ids))
        return self._logprobs(prompt.token_ids, entries, req.logprobs or 0, 0)

    # ---- non-streaming ----------------------------------------------------------------------------------
    async def _collect(self, req: CompletionRequest, prompts: list[_Prompt],
                       stream: AsyncIterator[tuple[int, RequestOutput]], request_id: str, model: str,
                       created: int) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in stream:
            if out.finished:
                finals[i] = out
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, prompt in enumerate(prompts):
            out = finals[i]
            prompt_tokens += len(prompt.token_ids)
            cached += out.num_cached_tokens
            for comp in out.outputs:
                completion_tokens += len(comp.token_ids)
                text, logprobs = comp.text, None
                if req.echo:
                    text = prompt.text + text
                if req.logprobs is not None:
                    echo_lp = self._echo_logprobs(req, out, prompt) if req.echo else None
                    start = len(prompt.text) if req.echo else 0
                    logprobs = self._logprobs(comp.token_ids, comp.logprobs or [], req.logprobs, start)
                    if echo_lp is not None:
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(echo_lp, name).extend(getattr(logprobs, name))
                        logprobs = echo_lp
                choices.append(CompletionChoice(
                    index=i * req.n + comp.index, text=text, logprobs=logprobs,
                    finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=self.usage(prompt_tokens, completion_tokens, cached),
                                  kv_transfer_params=finals[0].kv_transfer_params if len(prompts) == 1 else None)

    # ---- streaming ----------------------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, prompts: list[_Prompt],
                      stream: AsyncIterator[tuple[int, RequestOutput]], request_id: str, model: str,
                      created: int) -> AsyncIterator[str]:
        num_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}
        cached: dict[int, int] = {}
        echoed: set[int] = set()
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        try:
            async for i, out in stream:
                cached[i] = out.num_cached_tokens
                for comp in out.outputs:
                    index = i * req.n + comp.index
                    text, logprobs = comp.text, None
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = prompts[i].text + text
                        if req.logprobs is not None:
                            echo_lp = self._echo_logprobs(req, out, prompts[i])
                            yield sse({**base, "choices": [{"index": index, "text": prompts[i].text,
                                                            "logprobs": echo_lp.model_dump(),
                                                            "finish_reason": None}]})
                            text = comp.text
                        offsets[index] = len(prompts[i].text)
                    if req.logprobs is not None:
                        lp = self._logprobs(comp.token_ids, comp.logprobs or [], req.logprobs,
                                            offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + len(comp.text)
                        logprobs = lp.model_dump()
                    num_tokens[index] = num_tokens.get(index, 0) + len(comp.token_ids)
                    if not text and not comp.finish_reason and not comp.token_ids:
                        continue
                    yield sse({**base, "choices": [{
                        "index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}]})
            if req.stream_options and req.stream_options.include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                usage = self.usage(prompt_tokens, sum(num_tokens.values()), sum(cached.values()))
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
        except Exception as e:  # the status line is gone; report in-band, as OpenAI does
            yield stream_error(e)
        yield sse("[DONE]")
