"""Whisper's convolutions as matmuls over time-major input equal nn.Conv1d on the same parameters."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.models.whisper import TimeMajorConv1d


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("loaded", [True, False])  # taps built after loading, or per call
def test_equals_conv1d(stride: int, loaded: bool) -> None:
    torch.manual_seed(stride)
    conv = TimeMajorConv1d(6, 10, kernel_size=3, stride=stride, padding=1)
    if loaded:
        conv.process_weights_after_loading()
    x = torch.randn(2, 6, 21)  # [n, C_in, T], odd T: the strided last frame reads the padding
    expected = F.conv1d(x, conv.weight, conv.bias, stride=stride, padding=1)  # [n, C_out, T_out]
    got = conv.forward_time_major(x.transpose(1, 2))
    assert got.shape == (2, expected.shape[2], 10)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_refuses_what_it_does_not_compute() -> None:
    with pytest.raises(ValueError, match="groups=1"):
        TimeMajorConv1d(4, 4, kernel_size=3, groups=2)
