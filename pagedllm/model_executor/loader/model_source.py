"""Where a model's files are: a packaged model's short name (``loader/packaged_models.py``), a ``.gguf`` file, an HF
folder, a CTranslate2 folder, or a folder with one GGUF."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from pagedllm.config import DEFAULT_MODEL
from pagedllm.model_executor.loader.packaged_models import packaged_model, packaged_short_names


@dataclass
class ModelSource:
    """``folder`` holds config/tokenizer files (HF) or the GGUF; ``gguf_file`` is the GGUF's full path;
    ``ct2_file`` a CTranslate2 ``model.bin`` (Whisper, ``loader/ct2_whisper.py``)."""

    folder: str
    gguf_file: str | None = None
    ct2_file: str | None = None


def find_model_source(model: str | None) -> ModelSource:
    """Resolve ``model`` to files on disk (never the network); ValueError when it is not found."""
    name = (model or DEFAULT_MODEL).strip()
    packaged = packaged_model(name)
    if packaged is not None and not os.path.exists(name):  # a file or folder of that name wins
        return ModelSource(*packaged.locate())
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model: {name} is a file but not a .gguf file; "
                             "pass a GGUF file or an HF folder")
        return ModelSource(os.path.dirname(path), path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "model.bin")) and not glob.glob(os.path.join(path, "*.safetensors")):
            return ModelSource(path, ct2_file=os.path.join(path, "model.bin"))  # a CTranslate2 folder
        if os.path.isfile(os.path.join(path, "config.json")):
            if not glob.glob(os.path.join(path, "*.safetensors")):
                raise ValueError(f"model: {name} has a config.json but no *.safetensors weights")
            return ModelSource(path)
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0])
        if len(ggufs) > 1:
            raise ValueError(f"model: {name} holds {len(ggufs)} .gguf files; pass one of them: "
                             f"{[os.path.basename(g) for g in ggufs]}")
        raise ValueError(f"model: {name} has neither config.json + *.safetensors nor a .gguf file")
    raise ValueError(f"model: {name!r} not found: expected a short name "
                     f"({', '.join(packaged_short_names())}), "
                     "a .gguf file, or a local Hugging Face folder (no downloads)")

