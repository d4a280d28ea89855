"""xgrammar behind a small interface: compile a GrammarKey, make a matcher, allocate a bitmask.

The bitmask layout is xgrammar's: [rows, ceil(V/32)] int32, bit j of word w allows token 32*w + j, which is
what ``sample/ops.py`` unpacks. V is the model's vocab size (its LM head may be wider than the tokenizer;
the extra ids are never allowed).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pagedllm.logger import init_logger
from pagedllm.structured_output.params import GrammarKey

logger = init_logger(__name__)

# From this many constrained rows in a step, xgrammar fills their bitmasks on several threads.
BATCH_FILL_MIN_ROWS = 8


class XgrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # Our manager caches by key; xgrammar's own cache would hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch: xgr.BatchGrammarMatcher | None = None

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """Raises ValueError naming the field when the spec cannot be compiled."""
        try:
            if key.kind == "json":
                # Compact JSON: small models otherwise wander in whitespace and never close the object.
                return self.compiler.compile_json_schema(key.spec, any_whitespace=False, strict_mode=True)
            if key.kind == "json_object":
                # Any JSON *object* (OpenAI's json_object), not any JSON value as xgrammar's builtin grammar.
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                         strict_mode=False)
            if key.kind == "regex":
                return self.compiler.compile_regex(key.spec)
            if key.kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(key.spec))
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if key.kind == "grammar":
                return self.compiler.compile_grammar(key.spec)
        except Exception as e:  # xgrammar raises RuntimeError / its own errors with a useful message
            lines = str(e).strip().splitlines()
            # Drop xgrammar's "[time] file.cc:line: " prefix: the client needs the reason, not our paths.
            message = re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(e).__name__
            raise ValueError(f"structured_outputs.{key.kind}: cannot be compiled: {message}") from None
        raise ValueError(f"structured_outputs: unknown kind {key.kind!r}")

    @staticmethod
    def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of bitmask [len(matchers), ceil(V/32)] := the tokens matchers[i] allows next."""
        if len(matchers) >= BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads="auto")  # fills rows on a thread pool
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
            return
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, ceil(V/32)] int32, all tokens allowed."""
        return xgr.allocate_token_bitmask(rows, self.vocab_size)
