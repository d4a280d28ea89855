"""A reader for CTranslate2's ``model.bin`` (the faster-whisper layout), memory-mapped, no ctranslate2 needed.

The layout (version 6, all integers little-endian), as read from the files:

```
u32 binary version (6)
u16 n, n bytes    spec name, NUL-terminated ("WhisperSpec\\0")
u32 spec revision
u32 number of variables, then per variable:
    u16 n, n bytes    name, NUL-terminated ("encoder/layer_0/self_attention/linear_0/weight")
    u8 rank, rank x u32 dims
    u8 dtype          0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16
    u32 nbytes, nbytes of data (row-major)
u32 number of aliases, then per alias: u16 n + name, u16 n + target (``decoder/projection/weight`` ->
    ``decoder/embeddings/weight``: the tied output projection)
```

Rank-0 variables are the spec's attributes (``encoder/num_heads``, ``decoder/pre_norm`` ...).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field

import numpy as np

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5 (bf16) is not read


@dataclass
class CT2File:
    """The variables of one ``model.bin`` (arrays are read-only views of the mapped file) and its aliases."""

    path: str
    spec: str
    revision: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> np.ndarray:
        """A variable by name, through the aliases; ValueError naming the file when it is missing."""
        name = self.aliases.get(name, name)
        if name not in self.variables:
            raise ValueError(f"model: {self.path} has no variable {name!r} (is it a {self.spec} model?)")
        return self.variables[name]

    def scalar(self, name: str) -> int:
        return int(self.get(name).reshape(-1)[0])

    def has(self, name: str) -> bool:
        return self.aliases.get(name, name) in self.variables


def read_ct2_file(path: str) -> CT2File:
    """Parse ``path``'s header and map its variables (no data copied). ValueError on a file that is not one."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    offset = 0

    def take(fmt: str) -> tuple:
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    def text() -> str:
        nonlocal offset
        (n,) = take("<H")
        raw = bytes(data[offset:offset + n])
        offset += n
        return raw.rstrip(b"\0").decode()

    try:
        (version,) = take("<I")
        if version < 5 or version > 6:
            raise ValueError(f"model: {path} is not a CTranslate2 model.bin of version 5 or 6 (version {version})")
        spec = text()
        (revision,) = take("<I")
        out = CT2File(path, spec, revision)
        (num_vars,) = take("<I")
        for _ in range(num_vars):
            name = text()
            (rank,) = take("<B")
            dims = take("<" + "I" * rank) if rank else ()
            (code,) = take("<B")
            (nbytes,) = take("<I")
            if code not in _DTYPES:
                raise ValueError(f"model: {path}: variable {name!r} has dtype code {code}, which this reader does "
                                 "not read (float32, float16 and the integer types only)")
            dtype = _DTYPES[code]
            array = np.frombuffer(data, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize, offset=offset)
            out.variables[name] = array.reshape(dims) if rank else array
            offset += nbytes
        (num_aliases,) = take("<I")
        for _ in range(num_aliases):
            alias = text()
            out.aliases[alias] = text()
    except struct.error as e:
        raise ValueError(f"model: {path} ends early: not a complete CTranslate2 model.bin ({e})") from None
    return out
