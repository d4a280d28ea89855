"""Whisper's special tokens, read from the engine's own tokenizer, and the decoder prompt built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIMESTAMP_STEP_S = 0.02  # <|0.00|>, <|0.02|>, ... <|30.00|>
NUM_TIMESTAMPS = 1501
# Whisper's own test for a multilingual model: its vocabulary (text tokens, specials, timestamps) has at least
# this many entries (base 51865; the English-only models one fewer).
MULTILINGUAL_VOCAB_SIZE = 51865
TEXT_CONTEXT = 448  # n_text_ctx of every Whisper model
# Whisper keeps at most n_text_ctx // 2 - 1 previous-text tokens and samples at most n_text_ctx // 2.
MAX_PROMPT_TOKENS = TEXT_CONTEXT // 2 - 1
MAX_NEW_TOKENS = TEXT_CONTEXT // 2
TASKS = ("transcribe", "translate")


def _language_table() -> tuple[dict[str, str], dict[str, str]]:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return dict(LANGUAGES), dict(TO_LANGUAGE_CODE)


@dataclass(frozen=True)
class WhisperVocab:
    sot: int
    eot: int
    transcribe: int
    translate: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    language_ids: dict[str, int]  # language code ("en") -> its token id, in vocabulary order
    language_names: dict[str, str]  # code -> lower-case English name ("english"), as OpenAI reports it

    @property
    def timestamp_begin(self) -> int:
        """``<|0.00|>``: every id from here up is a timestamp (also when the tokenizer file lacks them)."""
        return self.no_timestamps + 1

    @property
    def is_multilingual(self) -> bool:
        return self.timestamp_begin + NUM_TIMESTAMPS >= MULTILINGUAL_VOCAB_SIZE

    def is_timestamp(self, token_id: int) -> bool:
        return token_id >= self.timestamp_begin

    def timestamp_s(self, token_id: int) -> float:
        return (token_id - self.timestamp_begin) * TIMESTAMP_STEP_S

    def is_text(self, token_id: int) -> bool:
        """Text tokens come before ``<|endoftext|>``; specials and timestamps after it."""
        return token_id < self.eot

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> WhisperVocab:
        def token_id(text: str) -> int:
            found = tokenizer.convert_tokens_to_ids(text)
            if not isinstance(found, int) or tokenizer.convert_ids_to_tokens(found) != text:
                raise ValueError(f"model: the tokenizer has no {text} token; is this a Whisper model?")
            return found

        names, _ = _language_table()
        language_ids = {}
        for code in names:
            found = tokenizer.convert_tokens_to_ids(f"<|{code}|>")
            if isinstance(found, int) and tokenizer.convert_ids_to_tokens(found) == f"<|{code}|>":
                language_ids[code] = found
        language_ids = dict(sorted(language_ids.items(), key=lambda kv: kv[1]))
        return cls(sot=token_id("<|startoftranscript|>"), eot=token_id("<|endoftext|>"),
                   transcribe=token_id("<|transcribe|>"), translate=token_id("<|translate|>"),
                   sot_prev=token_id("<|startofprev|>"),
                   no_speech=_first_id(tokenizer, ("<|nospeech|>", "<|nocaptions|>")),
                   no_timestamps=token_id("<|notimestamps|>"), language_ids=language_ids,
                   language_names={code: names[code] for code in language_ids})

    def language_code(self, language: str | None) -> str | None:
        """A language code the model knows, from a code ("de"), a name or an alias ("German", "castilian").

        None stays None (detect it). English-only models accept English only.
        """
        if language is None or not language.strip():
            return None
        key = language.strip().lower()
        _, aliases = _language_table()
        code = key if key in self.language_ids else aliases.get(key)
        if code is None or code not in self.language_ids:
            raise ValueError(f"language: unknown language {language!r}; use an ISO-639-1 code such as 'en' or 'de'")
        if not self.is_multilingual and code != "en":
            raise ValueError(f"language: this model is English-only and cannot transcribe {language!r}")
        return code

    def decoder_prompt(self, tokenizer: Any, language: str, task: str, timestamps: bool,
                       prompt: str | None = None) -> list[int]:
        """``[<|startofprev|> prev...] <|startoftranscript|> <|lang|> <|task|> [<|notimestamps|>]``.

        English-only models take neither a language nor a task token. The previous text is encoded as Whisper
        does (a leading space) and only its last ``MAX_PROMPT_TOKENS`` tokens are kept.
        """
        if task not in TASKS:
            raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
        ids: list[int] = []
        if prompt is not None and prompt.strip():
            previous = tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
            ids = [self.sot_prev, *previous[-MAX_PROMPT_TOKENS:]]
        ids.append(self.sot)
        if self.is_multilingual:
            ids += [self.language_ids[language], self.transcribe if task == "transcribe" else self.translate]
        elif task != "transcribe":
            raise ValueError("task: this model is English-only; it cannot translate")
        if not timestamps:
            ids.append(self.no_timestamps)
        return ids


def _first_id(tokenizer: Any, candidates: tuple[str, ...]) -> int:
    for text in candidates:
        found = tokenizer.convert_tokens_to_ids(text)
        if isinstance(found, int) and tokenizer.convert_ids_to_tokens(found) == text:
            return found
    raise ValueError(f"model: the tokenizer has none of {', '.join(candidates)}; is this a Whisper model?")
