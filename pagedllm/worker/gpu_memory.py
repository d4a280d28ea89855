"""How much GPU memory the KV cache gets under ``--gpu-memory-utilization``.

The engine may use ``utilization x total`` bytes of the GPU. Whatever is in use before the profiling step
(weights, the CUDA context, other processes) counts against it, then the activation peak of the largest
step the scheduler can issue, then a reserve for CUDA graphs and allocator slack; the KV cache gets the rest.
"""

from __future__ import annotations

from pagedllm.utils import format_bytes

# Decode graphs keep activations of at most a few hundred rows in their pool (tens of MiB for small models);
# the reserve also absorbs allocator fragmentation. Generous on purpose: running out later is worse.
GRAPH_AND_SLACK_RESERVE = 512 * 1024**2


def gpu_kv_cache_budget(total: int, used_before_profile: int, profile_peak: int, utilization: float,
                        reserve: int = GRAPH_AND_SLACK_RESERVE) -> int:
    """Bytes for the KV cache; ValueError naming ``gpu_memory_utilization`` when nothing is left.

    total: the GPU's memory; used_before_profile: bytes in use on the GPU (by anyone) before the profiling
    step; profile_peak: extra bytes the profiling step's peak needed on top of that.
    """
    allowed = int(total * utilization)
    budget = allowed - used_before_profile - profile_peak - reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization:g} of {format_bytes(total)} allows {format_bytes(allowed)}, but "
            f"{format_bytes(used_before_profile)} is in use already (weights, CUDA context, other processes), the "
            f"largest step needs {format_bytes(profile_peak)} more and {format_bytes(reserve)} is kept for CUDA "
            "graphs: no memory is left for the KV cache; raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or set --kv-cache-memory")
    return budget
