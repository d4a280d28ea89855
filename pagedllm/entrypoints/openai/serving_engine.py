"""What completions and chat share: model-name check, prompt-length check, ids, logprob shapes, SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.errors import EngineDeadError
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body, param_of
from pagedllm.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.utils import random_uuid


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models: ServingModels, tokenizer: Any) -> None:
        self.engine = engine
        self.models = models
        # The front end's own tokenizer copy: encoding here never contends with the engine thread's one.
        self.tokenizer = tokenizer
        self.processor = engine.engine.processor
        self.max_model_len: int = self.processor.max_model_len

    @staticmethod
    def make_id(prefix: str) -> str:
        return f"{prefix}-{random_uuid()}"

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, where: str) -> int | None:
        """Raise a 400 with the numbers if prompt + completion cannot fit; returns max_tokens to use."""
        limit = self.max_model_len
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{num_prompt_tokens} input tokens. Please reduce the length of the input {where}.",
                    param="messages" if where == "messages" else "prompt")
            return None
        if num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {where}, {max_tokens} "
                f"in the completion). Please reduce the length of the {where} or completion.",
                param="messages" if where == "messages" else "prompt")
        try:
            self.processor.check_fits(num_prompt_tokens)  # the KV cache bound
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt") from None
        return max_tokens

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))

    @staticmethod
    def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        """The k most likely tokens of one position, best first."""
        items = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                      -kv[1].logprob))
        return items[:k]

    def token_str(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def stream_error(exc: BaseException) -> str:
    status = 503 if isinstance(exc, EngineDeadError) else 400 if isinstance(exc, ValueError) else 500
    return sse(error_body(str(exc), status, param_of(str(exc)) if status == 400 else None))


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generate() streams as items arrive; closing this closes (aborts) all of them."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # abort now, not when the generator is garbage-collected
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # cancelling a pump runs its stream's abort handler


async def start_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``merge_streams`` once its first item is in: a request the engine refuses (ValueError) becomes a 400
    here, before any response starts. The result yields that first item, then the rest; closing it aborts all."""
    merged = merge_streams(streams)
    try:
        first = await merged.__anext__()
    except ValueError as e:
        await merged.aclose()
        raise OpenAIError(str(e), param=param_of(str(e))) from None

    async def rest() -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            yield first
            async for item in merged:
                yield item
        finally:
            await merged.aclose()

    return rest()


async def until_disconnect(request: Request, coro: Any) -> Any:
    """Run a non-streaming handler; if the client goes away first, cancel it (its streams abort)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()  # its streams abort as it unwinds
        watcher.cancel()
    if not task.done() or task.cancelled():
        return None  # the client left first (a cancelled task is not done until it has unwound)
    return task.result()
