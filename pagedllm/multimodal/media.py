"""Image URLs to decoded pictures, under the server's media policy.

- ``data:image/...;base64,...``: always accepted (the client sends the bytes).
- ``file://`` URLs: only under ``--allowed-local-media-path`` (vLLM's flag); off without it.
- ``http(s)://`` URLs: only from a host that ``--allowed-media-domains`` names; off by default, so the server never
  fetches arbitrary URLs for a client (server-side request forgery).

Decoding is Pillow's; a picture is converted to RGB (what vision processors take). Every refusal is a ValueError
naming ``image_url`` and the reason.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

# An http(s) image larger than this is refused while it downloads.
MAX_FETCH_BYTES = 32 << 20
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from besides data URLs."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()


def decode_image(data: bytes, source: str = "image") -> Any:
    """Pillow's decoding of ``data`` as an RGB image; ValueError when it is no image Pillow can read."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url: {source} is not an image that can be decoded ({e})") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def load_image(url: str, policy: MediaPolicy) -> Any:
    """The picture at ``url`` (data, file or http(s)), as the policy allows."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url: 'url' must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url), "the data URL")
    if scheme == "file":
        return decode_image(_local_file_bytes(url, policy), "the file")
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, policy), "the fetched URL")
    raise ValueError(f"image_url: unsupported URL scheme {scheme or url[:16]!r}; send a data: URL "
                     "(data:image/png;base64,...)")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ValueError("image_url: a data URL needs a ',' between its header and data")
    media_type, *params = header.split(";")
    if not media_type.lower().startswith("image/"):
        raise ValueError(f"image_url: the data URL's media type is {media_type or 'text/plain'!r}, not an image "
                         "(image/png, image/jpeg, ...)")
    if "base64" not in (p.lower() for p in params):
        raise ValueError("image_url: an image data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image_url: the data URL's base64 data is malformed") from None


def _local_file_bytes(url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if not root:
        raise ValueError("image_url: file:// URLs are off; start the server with --allowed-local-media-path DIR "
                         "to serve images from DIR")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(root)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"image_url: {url!r} is outside --allowed-local-media-path")
    if not os.path.isfile(path):
        raise ValueError(f"image_url: no such file {url!r}")
    with open(path, "rb") as f:
        return f.read()


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if not policy.allowed_media_domains:
        raise ValueError("image_url: fetching http(s) URLs is off; send the image as a data: URL, or start the "
                         "server with --allowed-media-domains")
    if host not in policy.allowed_media_domains:
        raise ValueError(f"image_url: domain {host!r} is not in --allowed-media-domains")
    opener = urllib.request.build_opener(_AllowedRedirects(policy.allowed_media_domains))
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_FETCH_BYTES + 1)
    except OSError as e:
        raise ValueError(f"image_url: could not fetch {url!r} ({e})") from None
    if len(data) > MAX_FETCH_BYTES:
        raise ValueError(f"image_url: {url!r} is larger than {MAX_FETCH_BYTES >> 20} MiB")
    return data


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host (else a redirect would reach any host)."""

    def __init__(self, allowed: tuple[str, ...]) -> None:
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 - urllib's signature
        host = (urllib.parse.urlparse(newurl).hostname or "").lower()
        if host not in self.allowed:
            raise ValueError(f"image_url: the URL redirects to {host!r}, which is not in --allowed-media-domains")
        return super().redirect_request(req, fp, code, msg, headers, newurl)
