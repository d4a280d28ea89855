"""An image's content hash: the key of the encoder cache and of the prefix cache's image-aware block hashes.

It covers the decoded pixels (mode, size, raw bytes), not the file: the same picture sent as PNG and as a data URL
hashes the same, and two pictures with the same bytes in different sizes do not.
"""

from __future__ import annotations

import hashlib
from typing import Any


def image_content_hash(image: Any) -> str:
    """sha256 (hex) of a PIL image's mode, size and pixels."""
    digest = hashlib.sha256()
    digest.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
