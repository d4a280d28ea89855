"""Turn a step's hidden states into one vector per request: MEAN / CLS / LAST pooling, Matryoshka, L2 norm.

A prompt may arrive in several chunks (decoder models with chunked prefill), so pooling is split into a
per-chunk ``accumulate`` (sums for MEAN, the first row for CLS) and a ``finish`` on the chunk that ends the
prompt. An encoder's prompts always come whole, and then it is one segment-sum over the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Pooler:
    """``pooling_type``: MEAN (average over the prompt), CLS (first token), LAST (last token)."""

    def __init__(self, pooling_type: str, normalize: bool) -> None:
        if pooling_type not in ("MEAN", "CLS", "LAST"):
            raise ValueError(f"pooling_type: unknown {pooling_type!r}")
        self.pooling_type = pooling_type
        self.normalize = normalize

    def pool_chunks(self, hidden: torch.Tensor, query_start_loc: list[int], chunk_starts: list[int],
                    partial: dict[int, torch.Tensor]) -> torch.Tensor:
        """hidden: [T, H] for R requests' chunks (``query_start_loc``: [R + 1]); ``chunk_starts``: each chunk's
        first prompt position; ``partial``: row -> what earlier chunks accumulated ([H] float32).

        Returns [R, H] float32: for MEAN the running sum (divide by the prompt length when it ends), for CLS
        the first token's state, for LAST this chunk's last token.
        """
        num_reqs = len(query_start_loc) - 1
        if self.pooling_type == "LAST":
            return hidden[[e - 1 for e in query_start_loc[1:]]].float()
        if self.pooling_type == "CLS":
            out = hidden[query_start_loc[:-1]].float()
        else:
            # Segment sums as one float32 matmul with a 0/1 [R, T] matrix (BLAS; index_add_ is far slower on
            # CPU). float32 even for bf16 states: a bf16 matmul would round the sums.
            lens = torch.tensor([query_start_loc[i + 1] - query_start_loc[i] for i in range(num_reqs)],
                                device=hidden.device)
            rows = torch.repeat_interleave(torch.arange(num_reqs, device=hidden.device), lens)
            select = torch.zeros(num_reqs, hidden.shape[0], dtype=torch.float32, device=hidden.device)
            select[rows, torch.arange(hidden.shape[0], device=hidden.device)] = 1
            out = select @ hidden.float()
        for row, value in partial.items():
            if self.pooling_type == "CLS" and chunk_starts[row] > 0:
                out[row] = value  # the first token was in an earlier chunk
            elif self.pooling_type == "MEAN":
                out[row] += value
        return out

    def finish(self, pooled: torch.Tensor, prompt_lens: list[int], normalize: list[bool],
               dimensions: list[int | None]) -> list[torch.Tensor]:
        """pooled: [R, H] from ``pool_chunks`` of the final chunks -> R float32 CPU vectors (Matryoshka
        truncation first, then L2 normalisation where asked)."""
        if self.pooling_type == "MEAN":
            pooled = pooled / torch.tensor(prompt_lens, dtype=torch.float32, device=pooled.device)[:, None]
        pooled = pooled.cpu()
        if not any(dimensions):  # the usual case: one normalisation for the whole batch
            if all(normalize):
                return list(F.normalize(pooled, dim=-1).unbind(0))
            if not any(normalize):
                return list(pooled.unbind(0))
        out = []
        for row, (norm, dims) in enumerate(zip(normalize, dimensions)):
            vec = pooled[row, :dims] if dims else pooled[row]
            out.append(F.normalize(vec, dim=-1) if norm else vec)
        return out
