"""The draw: processed logits [N, V] -> one token id per row (greedy argmax or a random inverse-CDF draw).

Random rows use one uniform per row (inverse CDF) instead of V noise values (an exponential race): on CPUs
drawing N x V noise cost more than the rest of the sampler. On CPUs the C++ kernel
(``kernels/csrc/sampling.cpp``) does softmax + inverse CDF in one pass that writes no [N, V] temporaries;
elsewhere torch does softmax, cumsum and searchsorted (``inverse_cdf``, the one torch draw: the sampler,
the rejection sampler and the model drafters all draw with it). Seeded rows draw from their own generator,
so their tokens do not depend on what else is in the batch. Nothing reads a value back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pagedllm.host_to_device import tensor_on
from pagedllm.platforms import platform_of
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SAMPLING_EPS


def row_uniforms(num_rows: int, generators: Mapping[int, torch.Generator], device: torch.device,
                 per_row: int = 1, dtype: torch.dtype = torch.float32, unseeded: bool = True) -> torch.Tensor:
    """[num_rows, per_row] uniforms in [0, 1) of ``dtype``: row r holds the next ``per_row`` values of
    ``generators[r]`` when it has one, else values from torch's default generator (one call for all rows;
    ``unseeded`` False: every row that matters has a generator, so the default one is not touched)."""
    u = torch.rand(num_rows, per_row, device=device, dtype=dtype) if unseeded \
        else torch.empty(num_rows, per_row, device=device, dtype=dtype)
    for row, generator in generators.items():
        u[row] = torch.rand(per_row, generator=generator, device=device, dtype=dtype)
    return u


def draw_uniforms(meta: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, [N, 1] float32; seeded rows draw from their own generator."""
    return row_uniforms(num_rows, meta.generators, device, unseeded=meta.has_unseeded_random)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """The one inverse-CDF draw: probs [N, V] (unnormalized, >= 0; NaN counts as 0) and u [N] or [N, 1]
    uniforms in [0, 1) -> [N] int64, per row the first token whose cumulative probability reaches
    (1 - u) x the row's total.

    The CDF accumulates in u's dtype: float32 for the sampler, float64 where speculation draws (its
    rejection rule compares probabilities of V-token rows). ``in_place``: probs may be overwritten (no
    copy when it already has u's dtype). A row whose probabilities are all NaN or 0 yields token 0.
    """
    cdf = probs.to(u.dtype, copy=not in_place).nan_to_num_(0.0).cumsum_(dim=1)
    # 1 - U lies in (0, 1]: a zero-probability token (flat step of the CDF) can never be the first >= u.
    target = (1.0 - u.reshape(-1, 1)) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).clamp_(max=probs.shape[1] - 1).squeeze(1)


def inverse_cdf_sample(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sample one token per row of probs [N, V] (changed in place) with one uniform draw per row.

    A row whose probabilities are all NaN (every logit was -inf) yields token 0, like argmax.
    """
    u = draw_uniforms(meta, probs.shape[0], probs.device).to(probs.dtype)
    return inverse_cdf(probs, u, in_place=True)


def draw_random(logits: torch.Tensor, meta: SamplingMetadata, temperature: torch.Tensor | None,
                private: bool) -> torch.Tensor:
    """logits [N, V] -> [N] ids drawn from softmax(logits / temperature); temperature [N] or None (= 1).

    ``private``: logits is the sampler's own copy and may be changed in place.
    """
    kernels = platform_of(logits).cpu_kernels(logits.dtype)
    # The C++ pass only where temperature is the last stage (fused here), as before the stages existed:
    # truncated rows keep the torch draw, so seeded outputs stay what they were.
    if kernels is not None and temperature is not None and logits.stride(1) == 1:
        u = draw_uniforms(meta, logits.shape[0], logits.device)
        return kernels.sample_from_logits(logits, temperature, u.squeeze(1))
    if temperature is not None:
        logits = logits.div(temperature.unsqueeze(1)) if not private else logits.div_(temperature.unsqueeze(1))
    probs = logits.softmax(dim=1)
    return inverse_cdf_sample(probs, meta)


def masked_draw_kernel(logits: torch.Tensor, copied: bool = False) -> Any | None:
    """The C++ kernels when they can draw ``logits`` under the grammar bitmask themselves, else None.

    ``copied``: the draw will get a contiguous float32 copy of ``logits``, not ``logits`` itself.
    """
    if not copied and logits.stride(1) != 1:
        return None
    kernels = platform_of(logits).cpu_kernels(torch.float32 if copied else logits.dtype)
    # None: no compiler; no sample_masked: a prebuilt library from before it existed.
    return kernels if kernels is not None and hasattr(kernels, "sample_masked") else None


def draw_masked(logits: torch.Tensor, meta: SamplingMetadata, grammar_rows: torch.Tensor, grammar_bitmask: torch.Tensor,
                temperature: torch.Tensor | None) -> torch.Tensor:
    """The draw with the grammar bitmask fused in (CPU): logits [N, V] float32 -> [N] int64, logits only read.

    ``grammar_rows`` [M] int64 pick only among the tokens their ``grammar_bitmask`` [M, ceil(V/32)] int32 rows
    allow (argmax or inverse CDF);
    the others draw exactly as ``draw`` does (same uniforms, same kernel loop, same argmax tie rule), so a
    free request's tokens do not change when a constrained one joins its batch.
    """
    kernels = masked_draw_kernel(logits)
    assert kernels is not None
    num_rows = logits.shape[0]
    if meta.all_greedy:
        greedy = torch.ones(num_rows, dtype=torch.bool)
        u = torch.zeros(num_rows)  # greedy rows consume no random numbers, as in ``draw``
    else:
        greedy = meta.greedy_mask if meta.greedy_mask is not None else torch.zeros(num_rows, dtype=torch.bool)
        u = draw_uniforms(meta, num_rows, logits.device).squeeze(1)
    if temperature is None:
        temperature = torch.ones(num_rows)
    mask_row = torch.full((num_rows,), -1, dtype=torch.int64)
    mask_row[grammar_rows] = torch.arange(grammar_rows.shape[0])
    return kernels.sample_masked(logits, temperature, u, greedy, grammar_bitmask, mask_row)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64, the first index of each row's largest logit (``argmax``'s rule); the C++ kernel
    on CPU float32 rows, much faster than torch's argmax on a 49k-vocabulary row (docs/performance.md)."""
    kernels = platform_of(logits).cpu_kernels(logits.dtype) if logits.dim() == 2 and logits.stride(1) == 1 else None
    if kernels is not None and hasattr(kernels, "argmax_rows"):  # hasattr: a prebuilt library from before it
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=1)


def draw(logits: torch.Tensor, meta: SamplingMetadata, temperature: torch.Tensor | None = None,
         private: bool = False) -> torch.Tensor:
    """Processed logits [N, V] -> [N] int64: argmax on greedy rows, a random draw on the others.

    ``temperature`` [N]: divide random rows' logits by it first (set when the temperature stage was
    fused into the draw); greedy rows ignore it.
    """
    greedy_ids = None if meta.all_random else greedy_tokens(logits)
    if meta.all_greedy:
        assert greedy_ids is not None
        return greedy_ids
    sampled = draw_random(logits, meta, temperature, private)
    if greedy_ids is not None:
        sampled = torch.where(meta.greedy_mask, greedy_ids, sampled)
    return sampled


def draw_drafts(logits: torch.Tensor, temperatures: Sequence[float], generators: Sequence[torch.Generator | None]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's draw: logits [M, V] -> (tokens [M] int64, probs [M, V] float32, or None when every row is greedy).

    Row i is greedy (argmax) when ``temperatures[i]`` is below ``SAMPLING_EPS``, else drawn from
    softmax(logits_i / temperature_i), which probs keeps (the distribution its draft came from, for the
    verifier; anything on greedy rows). Random rows draw one float64 uniform each, seeded ones from
    ``generators[i]``.
    """
    greedy_rows = [i for i, t in enumerate(temperatures) if t < SAMPLING_EPS]
    if len(greedy_rows) == len(temperatures):
        return greedy_tokens(logits), None
    device = logits.device
    temperature = tensor_on([max(t, SAMPLING_EPS) for t in temperatures], torch.float32, device)
    probs = (logits.float() / temperature.unsqueeze(1)).softmax(dim=1)
    random_rows = [i for i, t in enumerate(temperatures) if t >= SAMPLING_EPS]
    seeded = {i: generators[i] for i in random_rows if generators[i] is not None}
    u = row_uniforms(len(temperatures), seeded, device, dtype=torch.float64, unseeded=len(seeded) < len(random_rows))
    tokens = inverse_cdf(probs, u)
    if greedy_rows:
        greedy = tensor_on([t < SAMPLING_EPS for t in temperatures], torch.bool, device)
        tokens = torch.where(greedy, greedy_tokens(logits), tokens)
    return tokens, probs
