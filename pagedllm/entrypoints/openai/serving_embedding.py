"""``POST /v1/embeddings``, ``/pooling`` and ``/score`` on a pooling model.

Every input is tokenized and checked here first, so a request with one bad input is a 400 before any of
its inputs reaches the engine; then all inputs go in at once and the scheduler batches them by tokens.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import torch
from fastapi import Request

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    UsageInfo,
    _PoolingFields,
)
from pagedllm.entrypoints.openai.serving_engine import until_disconnect
from pagedllm.entrypoints.openai.serving_models import ServingModels
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.utils import random_uuid


def encode_vector(vec: torch.Tensor, encoding_format: str) -> list[float] | str:
    """float: a list; base64: little-endian float32 bytes, as OpenAI's API returns them."""
    if encoding_format == "base64":
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


class ServingEmbedding:
    def __init__(self, engine: AsyncLLM, models: ServingModels, tokenizer: Any) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer  # the front end's own copy
        mc = engine.engine.config.model
        self.max_model_len: int = engine.engine.processor.max_model_len
        self.vocab_size: int = mc.vocab_size
        self.hidden_size = int(getattr(mc.hf_config, "hidden_size", 0) or 0)
        self.matryoshka = bool(mc.pooler_config and mc.pooler_config.enable_matryoshka)

    # ---- inputs ------------------------------------------------------------------------------------------
    def _token_ids(self, raw: Any, req: _PoolingFields, field: str) -> list[list[int]]:
        """Token ids of each input (truncated as asked), or a 400 naming ``field``."""
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise OpenAIError(f"{field}: must not be empty", param=field)
        limit = req.truncate_prompt_tokens
        if limit is not None:
            if limit == -1:
                limit = self.max_model_len
            if limit < 1 or limit > self.max_model_len:
                raise OpenAIError(f"truncate_prompt_tokens: must be -1 or in [1, {self.max_model_len}], got "
                                  f"{req.truncate_prompt_tokens}", param="truncate_prompt_tokens")
        out = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                if not item:
                    raise OpenAIError(f"{field}[{i}]: must not be an empty string", param=field)
                if limit is None:
                    ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                else:
                    ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens, truncation=True,
                                                max_length=limit)
            else:
                if not item:
                    raise OpenAIError(f"{field}[{i}]: the token id list must not be empty", param=field)
                bad = [t for t in item if t < 0 or t >= self.vocab_size]
                if bad:
                    raise OpenAIError(f"{field}[{i}]: token id {bad[0]} is out of range [0, {self.vocab_size})",
                                      param=field)
                ids = list(item)[-limit:] if limit is not None else list(item)
            if len(ids) > self.max_model_len:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, input {i} "
                    f"has {len(ids)} tokens. Please reduce the length of the input, or set "
                    "truncate_prompt_tokens.", param=field)
            out.append(ids)
        return out

    def _params(self, req: _PoolingFields, dimensions: int | None = None) -> PoolingParams:
        if dimensions is not None and not self.matryoshka:
            raise OpenAIError(f"dimensions: model {self.models.default_name!r} does not support Matryoshka "
                              "representations, so its embeddings cannot be shortened", param="dimensions")
        if dimensions is not None and self.hidden_size and not 1 <= dimensions <= self.hidden_size:
            raise OpenAIError(f"dimensions: must be in [1, {self.hidden_size}], got {dimensions}",
                              param="dimensions")
        try:
            return PoolingParams(normalize=req.normalize, dimensions=dimensions)
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(":", 1)[0]) from None

    async def _pool(self, inputs: list[list[int]], params: PoolingParams, prefix: str,
                    raw_request: Request) -> list[PoolingRequestOutput] | None:
        """Pool every input concurrently; None if the client went away (the requests are aborted)."""
        async def run_all() -> list[PoolingRequestOutput]:
            tasks = [asyncio.ensure_future(self.engine.encode({"prompt_token_ids": ids}, params, f"{prefix}-{i}"))
                     for i, ids in enumerate(inputs)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for task in tasks:  # one input failed (or we were cancelled): abort the rest
                    task.cancel()

        return await until_disconnect(raw_request, run_all())

    @staticmethod
    def _usage(inputs: list[list[int]]) -> UsageInfo:
        n = sum(len(ids) for ids in inputs)
        return UsageInfo(prompt_tokens=n, total_tokens=n)

    # ---- endpoints ---------------------------------------------------------------------------------------
    async def _pool_input(self, req: EmbeddingRequest | PoolingRequest, raw_request: Request, kind: str):
        """``req.input`` pooled: (model name, request id, [encoded vector per input], usage), or None when the
        client went away. The embeddings and pooling endpoints differ only in how they wrap the result."""
        model = self.models.check(req.model)
        inputs = self._token_ids(req.input, req, "input")
        request_id = f"{kind}-{random_uuid()}"
        outputs = await self._pool(inputs, self._params(req, req.dimensions), request_id, raw_request)
        if outputs is None:
            return None
        vectors = [encode_vector(o.outputs.data, req.encoding_format) for o in outputs]
        return model, request_id, vectors, self._usage(inputs)

    async def embeddings(self, req: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse | None:
        pooled = await self._pool_input(req, raw_request, "embd")
        if pooled is None:
            return None
        model, request_id, vectors, usage = pooled
        data = [EmbeddingData(index=i, embedding=v) for i, v in enumerate(vectors)]
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)

    async def pooling(self, req: PoolingRequest, raw_request: Request) -> PoolingResponse | None:
        pooled = await self._pool_input(req, raw_request, "pool")
        if pooled is None:
            return None
        model, request_id, vectors, usage = pooled
        data = [PoolingData(index=i, data=v) for i, v in enumerate(vectors)]
        return PoolingResponse(id=request_id, model=model, data=data, usage=usage)

    async def score(self, req: ScoreRequest, raw_request: Request) -> ScoreResponse | None:
        model = self.models.check(req.model)
        first = self._token_ids(req.text_1, req, "text_1")
        second = self._token_ids(req.text_2, req, "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise OpenAIError(f"text_1: {len(first)} texts for {len(second)} in text_2; give one text_1 or as "
                              "many as text_2", param="text_1")
        params = self._params(req)
        request_id = f"score-{random_uuid()}"
        outputs = await self._pool(first + second, params, request_id, raw_request)
        if outputs is None:
            return None
        vecs = torch.stack([o.outputs.data for o in outputs])
        a, b = vecs[:len(first)], vecs[len(first):]
        scores = torch.nn.functional.cosine_similarity(a.expand_as(b) if len(first) == 1 else a, b, dim=-1)
        data = [ScoreData(index=i, score=float(s)) for i, s in enumerate(scores.tolist())]
        return ScoreResponse(id=request_id, model=model, data=data, usage=self._usage(first + second))


__all__ = ["ServingEmbedding", "encode_vector"]
