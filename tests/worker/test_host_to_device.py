"""Host-to-device helpers (host_to_device.py) and the runner's row pick: same values as the blocking calls they
replace; on the CPU no copy is made where none was. (The pinned, non-blocking branch runs on CUDA only:
benchmarks/gpu_check.sh runs the engine there.)"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.host_to_device import index_rows as _rows_of
from pagedllm.host_to_device import tensor_on, to_device


def test_helpers_match_blocking_copies_on_the_cpu() -> None:
    t = torch.from_numpy(np.arange(6, dtype=np.int64))
    assert to_device(t, "cpu") is t
    got = tensor_on([1.5, 2.0], torch.float32, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.tolist() == [1.5, 2.0]
    assert tensor_on([], torch.int64, "cpu").shape == (0,)
    assert tensor_on([True, False], torch.bool, "cpu").tolist() == [True, False]


def test_rows_of_views_leading_rows_and_gathers_others() -> None:
    hidden = torch.arange(12.0).view(6, 2)
    lead = _rows_of(hidden, [0, 1, 2])
    assert lead.data_ptr() == hidden.data_ptr() and lead.shape == (3, 2)  # a decode step: no gather
    torch.testing.assert_close(_rows_of(hidden, [1, 4, 5]), hidden[[1, 4, 5]])
    torch.testing.assert_close(_rows_of(hidden, [2]), hidden[[2]])
