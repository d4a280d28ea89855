"""Incremental detokenization with stop strings, in the front end (never in the engine loop)."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from pagedllm.sampling_params import SamplingParams

# Prompt tokens fed to the stream as context so the first output token decodes as it would in place
# (leading spaces of SentencePiece-style tokenizers depend on what precedes them).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive; finds stop strings.

    Multi-byte characters split across tokens are held back by ``tokenizers.DecodeStream`` until whole.
    When streaming with stop strings, the last ``max_stop_len - 1`` characters are held back too, so a
    stop string is never half-sent.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer
        context = prompt_token_ids[-_CONTEXT_TOKENS:] if prompt_token_ids else None
        try:
            self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        except TypeError:  # older tokenizers without prefix support
            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = [s for s in (params.stop or []) if s]
        self.include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self.output_text = ""
        self._sent = 0  # characters already handed out as deltas

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string if one now appears (text is then cut at it)."""
        for token_id in new_token_ids:
            chunk = self._stream.step(self._backend, token_id)
            if not chunk:
                continue
            start = max(0, len(self.output_text) - (max((len(s) for s in self.stop), default=0) - 1))
            self.output_text += chunk
            for stop in self.stop:
                idx = self.output_text.find(stop, start)
                if idx != -1:
                    self.output_text = self.output_text[:idx + (len(stop) if self.include_stop else 0)]
                    return stop
        return None

    def get_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string prefix until finished."""
        end = len(self.output_text) if finished else max(self._sent, len(self.output_text) - self._hold)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta
