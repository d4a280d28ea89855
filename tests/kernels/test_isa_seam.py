"""The quantized CPU kernels are written once against the vector layer (kernels/csrc/simd/) and compiled per
instruction set by the isa_*.cpp units; the kernels' entry points choose a set through isa::kernels_for only. A
count of intrinsics and ISA target attributes in the entry points is zero."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "pagedllm" / "kernels" / "csrc"
# The quantized matmuls' entry points: argument checks, a table from kernels_for, the tile loop.
ENTRY_POINTS = ("quant_gemm.cpp", "q4_dot_gemm.cpp", "q8_dot_gemm.cpp", "w8a8_gemm.cpp", "dot_gemm.h", "tile_loop.h")
# The tiles: templates over the layer, no intrinsics of their own.
TILES = ("simd/widen_tiles.h", "simd/dot_tiles.h")
ISA_CODE = re.compile(r"_mm\d*_\w+|__m\d+i?\b|target\(\"|#pragma GCC target|__AVX\w*__")


def isa_code(root: Path, files: tuple[str, ...]) -> dict[str, int]:
    found = {}
    for name in files:
        hits = len(ISA_CODE.findall((root / name).read_text()))
        if hits:
            found[name] = hits
    return found


def test_entry_points_and_tiles_hold_no_isa_code() -> None:
    assert isa_code(CSRC, ENTRY_POINTS + TILES) == {}


def test_the_count_sees_isa_code(tmp_path: Path) -> None:  # the count above must be able to fail
    (tmp_path / "k.cpp").write_text('__attribute__((target("avx2"))) void f() { __m256 v = _mm256_setzero_ps(); }\n')
    assert isa_code(tmp_path, ("k.cpp",)) == {"k.cpp": 3}


def test_each_isa_unit_compiles_the_shared_tiles() -> None:
    """Every ISA's tiles come from the same templates: each unit includes them, and only the layer differs."""
    units = {"isa_generic.cpp": "vec_scalar.h", "isa_avx2.cpp": "vec_avx2.h", "isa_avx512.cpp": "vec_avx512.h",
             "isa_vnni512.cpp": "vec_avx512.h"}
    for unit, layer in units.items():
        text = (CSRC / unit).read_text()
        assert f'#include "simd/{layer}"' in text, unit
        assert '#include "simd/widen_tiles.h"' in text or '#include "simd/dot_tiles.h"' in text, unit
