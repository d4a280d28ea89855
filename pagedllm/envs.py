"""Every environment variable pagedllm reads, in one table (docs/environment.md lists the same).

Nothing else in the package reads ``os.environ``: code asks here, by the variable's name as an attribute
(``envs.PAGEDLLM_CPU_ISA``). A value is parsed each time it is asked for, so a test or a parent process that sets
a variable before the reader runs is seen; callers that must decide once cache the answer themselves. A value
that does not parse raises ValueError naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(options)}")
        return value

    return parse


def _integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _text(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True)
class EnvVar:
    """One variable: its default when unset (None: no value) and what it does."""

    name: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        return self.default if raw is None or raw == "" else self.parse(self.name, raw)


VARIABLES: dict[str, EnvVar] = {v.name: v for v in [
    EnvVar("PAGEDLLM_ENABLE_MULTIPROCESSING", True, _flag,
           "`0` runs the server's engine core on a thread of the API process instead of in its own process "
           "(vLLM: `VLLM_ENABLE_V1_MULTIPROCESSING`); for debugging in one interpreter."),
    EnvVar("PAGEDLLM_API_KEY", None, _text,
           "The key clients must send as `Authorization: Bearer ...` when `--api-key` is not given."),
    EnvVar("PAGEDLLM_LOGGING_LEVEL", "INFO", _choice("debug", "info", "warning", "error", "critical"),
           "Level of pagedllm's own log lines."),
    EnvVar("PAGEDLLM_CPU_KERNELS", True, _flag,
           "`0` never builds or loads the C++ CPU kernels: the torch ops run instead (slower, same results)."),
    EnvVar("PAGEDLLM_CPU_MARCH", "native", _text,
           "The `-march` the C++ CPU kernels are compiled for, e.g. `x86-64-v3` for an image that must run on "
           "any AVX2 + FMA machine."),
    EnvVar("PAGEDLLM_CPU_KERNELS_PREBUILT", None, _text,
           "A kernels library built earlier (the `.so`, or a folder holding one `pagedllm_cpu_kernels_*.so`), "
           "imported as is: no compiler or build step at start-up (container images)."),
    EnvVar("PAGEDLLM_CPU_ISA", "auto", _choice("auto", "avx2", "avx512", "generic"),
           "Forces the instruction set of the quantized CPU matmuls (`auto` picks the best this CPU has)."),
    EnvVar("PAGEDLLM_CPU_KERNEL_AUTOTUNE", "on", _choice("off", "on", "force"),
           "Default of `--cpu-kernel-autotune`: `on` times the quantized CPU matmuls' candidate kernels per "
           "shape and row count once per machine (the table is saved), `force` measures again, `off` keeps the "
           "default kernel."),
    EnvVar("PAGEDLLM_CPU_DENSE_COPY", "auto", _choice("auto", "on", "off", "bf16"),
           "Whether the kernel autotuner may give a quantized CPU weight a dense float32 copy for the buckets of "
           "rows where BLAS measures faster (many rows): `auto` while the copies of the whole model fit in a "
           "quarter of the available memory, `on` always, `off` never (the quantized kernels at every batch "
           "size); `bf16` always, as bf16 copies where the CPU has native bf16 (half the bytes, faster, but "
           "many-row steps round activations to bf16: a request's greedy tokens may differ between batch sizes)."),
    EnvVar("PAGEDLLM_ENCODER_ATTENTION_BF16", "auto", _choice("auto", "amx", "avx512_bf16", "off"),
           "bf16 encoder attention (Whisper's encoder, BERT-style models) on the CPU: `auto` runs it on AMX tiles "
           "where the CPU has them, else on AVX-512 BF16 dot products where it has those (which then take a "
           "decoder's long prompts and their later chunks too); `amx` or `avx512_bf16` only that kernel; `off` (and "
           "a CPU with neither) the generic CPU kernel up to 512 positions and torch's SDPA beyond (comparisons)."),
    EnvVar("PAGEDLLM_PROMPT_ATTENTION_FLOAT32", "auto", _choice("auto", "kernel", "sdpa"),
           "float32 prompts past the paged CPU kernel's lengths (fresh, or later chunks over their context): `auto` "
           "attends them in the causal generic CPU kernel where the kernels are built for AVX-512, in torch's SDPA "
           "elsewhere; `kernel` or `sdpa` that path on any CPU (comparisons on CPU kinds not measured)."),
    EnvVar("PAGEDLLM_KV_CACHE_PREFAULT", True, _flag,
           "Default of `--kv-cache-prefault`: write the CPU KV cache's pages at start-up (1) or map them as blocks "
           "are first used (0)."),
    EnvVar("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", None, _text,
           "A kernel-choice table (JSON, as saved in the cache folder) to use instead of measuring: forces "
           "its choices (tests, comparisons); never written."),
    EnvVar("PAGEDLLM_CACHE_DIR", None, _text,
           "Where pagedllm keeps what it made or measured on this machine: models shipped in parts, joined on "
           "first use (Whisper base's CTranslate2 `model.bin`), and the kernel autotune table; default "
           "`$XDG_CACHE_HOME/pagedllm` or `~/.cache/pagedllm`."),
    EnvVar("XDG_CACHE_HOME", None, _text, "The user's cache folder (read for pagedllm's default cache folder)."),
    EnvVar("PAGEDLLM_Q4_LAYOUT", "dot8", _choice("dot8", "pairs"),
           "Packing of 4-bit CPU weights whose group is a multiple of 8: `pairs` is the older layout, kept "
           "for comparisons."),
    EnvVar("PAGEDLLM_TRITON_ARCH", 90, _integer,
           "The GPU architecture (major * 10 + minor) Triton launches tune for when no GPU is present (the "
           "interpreter, the ahead-of-time compile check)."),
    EnvVar("VLLM_NIXL_SIDE_CHANNEL_PORT", None, _integer,
           "The port of the NixlConnector's handshake side channel (vLLM's variable) when `kv_port` is not in "
           "`--kv-transfer-config`; unset: a free port is picked per instance."),
    EnvVar("TRITON_INTERPRET", False, _flag,
           "Triton's own switch: `1` runs the Triton kernels in its interpreter on the CPU (the tests do)."),
    EnvVar("TORCH_EXTENSIONS_DIR", None, _text,
           "torch's own folder for built extensions: where the C++ CPU kernels are compiled and cached "
           "(default `~/.cache/torch_extensions`)."),
    EnvVar("RAY_ADDRESS", None, _text,
           "Ray's own variable: the cluster the `ray` executor and `--data-parallel-backend ray` join when "
           "`--ray-address` is not given (default: a local Ray instance started by the server)."),
    EnvVar("OMP_NUM_THREADS", None, _text,
           "OpenMP's own thread count; when set, the CPU worker leaves torch's thread count to it (default: "
           "one thread per physical core)."),
]}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()

