"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra endpoints)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import ServingChat


class ServingTokenization:
    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat  # reuses its tokenizer, model check and chat template rendering

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        chat = self.chat
        chat.models.check(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("tokenize: give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            ids = chat.render(req.messages, req.add_generation_prompt)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = chat.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        strs = chat.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=chat.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        chat = self.chat
        chat.models.check(req.model)
        vocab = chat.processor.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens: token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=chat.tokenizer.decode(req.tokens))
