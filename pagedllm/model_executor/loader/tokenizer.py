"""``load_tokenizer``: the fast tokenizer for a resolved ModelConfig, with its chat template."""

from __future__ import annotations

import os
from typing import Any

from pagedllm.config import ModelConfig


def _read_template(chat_template: str) -> str:
    """``chat_template`` is a path to a Jinja file or the template text itself."""
    path = os.path.expanduser(chat_template)
    if len(chat_template) < 4096 and "{" not in chat_template and os.path.isfile(path):
        with open(path) as f:
            return f.read()
    if "{" not in chat_template:
        raise ValueError(f"chat_template: {chat_template!r} is neither a file nor a Jinja template")
    return chat_template


def _gguf_tokenizer(path: str) -> Any:
    """Tokenizer from GGUF metadata.

    ``AutoTokenizer.from_pretrained(gguf_file=...)`` also parses the whole file for the model config with
    ``GGUFReader``, several times slower than building from the metadata alone (docs/performance.md).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # another transformers layout: take the slow, public road
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             local_files_only=True)
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _ct2_whisper_tokenizer(folder: str) -> Any:
    """A CTranslate2 Whisper folder's ``tokenizer.json`` as a ``WhisperTokenizerFast`` told every special token
    (without the list, transformers decodes timestamps at the wrong offset), with the timestamp tokens
    ``<|0.00|>`` ... ``<|30.00|>`` after ``<|notimestamps|>`` added where the file lacks them (tiny.en's)."""
    from tokenizers import AddedToken
    from transformers import WhisperTokenizerFast

    from pagedllm.model_executor.loader.ct2_whisper import timestamp_tokens, whisper_special_tokens

    tok = WhisperTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"),
                               additional_special_tokens=whisper_special_tokens(folder))
    stamps = timestamp_tokens()
    if tok.convert_tokens_to_ids(stamps[0]) == tok.unk_token_id:
        no_timestamps = tok.convert_tokens_to_ids("<|notimestamps|>")
        if len(tok) != no_timestamps + 1:
            raise ValueError(f"tokenizer: {folder}/tokenizer.json has no timestamp tokens and cannot take them after "
                             f"<|notimestamps|> ({no_timestamps}): it holds {len(tok)} tokens")
        tok.add_tokens([AddedToken(s, lstrip=False, rstrip=False, normalized=True, special=False) for s in stamps])
    return tok


def load_tokenizer(mc: ModelConfig) -> Any:
    """A ``transformers`` fast tokenizer for ``mc`` (resolved, or resolved here).

    ``mc.tokenizer`` (an HF folder) overrides the model's own; the chat template comes from the folder or
    the GGUF metadata, unless ``mc.chat_template`` (path or literal Jinja) overrides it.
    """
    from transformers import AutoTokenizer

    if not mc.model_path:
        from pagedllm.model_executor.loader.model_config import resolve_model_config

        resolve_model_config(mc)
    if mc.tokenizer:
        if not os.path.isdir(mc.tokenizer):
            raise ValueError(f"tokenizer: {mc.tokenizer!r} is not a local folder")
        tok = AutoTokenizer.from_pretrained(mc.tokenizer, local_files_only=True)
    elif mc.gguf_file:
        tok = _gguf_tokenizer(mc.gguf_file)
    elif mc.ct2_file:
        tok = _ct2_whisper_tokenizer(mc.model_path)
    else:
        tok = AutoTokenizer.from_pretrained(mc.model_path, local_files_only=True)
    if not tok.is_fast:
        raise ValueError(f"tokenizer: {mc.tokenizer or mc.model_path} has no fast tokenizer")
    if mc.chat_template:
        tok.chat_template = _read_template(mc.chat_template)
    return tok
