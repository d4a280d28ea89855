"""The many-rows path of quantized CPU weights (``dense_copy.py``) and the autotuner's trust in its table.

Every kernel path (the quantized layouts and ISAs, and the dense copies) against a float reference at 1, 17, 64
and 256 rows for every format and group size, including an LM head shape (a smaller vocabulary on the same code
path: N not a multiple of 16, K = 576 as SmolLM2's); the choice logic on recorded tables; the median, the
neighbour re-measure and the refresh of busy entries with fake timers and loads (nothing here is timed)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedllm.benchmarks import kernels as bench_kernels
from pagedllm.kernels import autotune
from pagedllm.kernels.cpu import ISA_CODES, cpu_isa
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import dense_copy, kernel_choice
from pagedllm.model_executor.layers.quantization.dense_copy import dense_copies_allowed, is_dense
from pagedllm.model_executor.layers.quantization.qpanels import (
    QPanels,
    quantize_f8,
    quantize_q4,
    quantize_q8,
)
from pagedllm.model_executor.layers.quantization.weight_only import Int8Config
from pagedllm.platforms import platform_for

from helpers.autotune import LayersModel, use_own_autotune_cache

KERNELS = platform_for(torch.device("cpu")).cpu_kernels(torch.float32)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
ROWS = (1, 17, 64, 256)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    use_own_autotune_cache(tmp_path, monkeypatch)


def _weight(fmt: str, n: int, k: int, group: int) -> QPanels:
    torch.manual_seed(n + k + group)
    w = torch.randn(n, k)
    if fmt.startswith("q4"):
        q, scales, mins = quantize_q4(w, group)
        return QPanels.pack_q4(q, scales.half().float(), mins.half().float(), fmt.split("-")[1])
    if fmt == "int8":
        return QPanels.pack_q8(*quantize_q8(w, group))
    if fmt == "w8a8":
        return QPanels.pack_w8a8(*quantize_q8(w, k))  # per channel
    return QPanels.pack_f8(*quantize_f8(w, group))


FORMATS = [("int8", 32), ("int8", 128), ("w8a8", 128), ("q4-dot8", 32), ("q4-dot8", 64), ("q4-pairs", 32),
           ("q4-pairs", 128), ("fp8", 32), ("fp8", 128)]


def _check(weight: QPanels, makers: dict, rows_list: tuple[int, ...] = ROWS) -> set[str]:
    reference = weight.dequantize()
    bias = torch.randn(weight.out_features)
    for rows in rows_list:
        x = torch.randn(rows, weight.in_features)
        expected = x @ reference.T + bias
        scale = expected.abs().max().item()
        for name, make in makers.items():
            packed, isa = make()
            got = packed.bind(isa)(x, bias, None)
            out = torch.empty_like(expected)
            assert packed.bind(isa)(x, bias, out) is out  # an ``out`` destination is written
            torch.testing.assert_close(out, got, rtol=0, atol=0)
            if name.startswith("dense-bf16") or (weight.layout == "panels" and type(weight).__name__ == "W8A8Panels"
                                                 and rows >= 16):
                # x and w rounded to bf16, sums in float32, the result rounded to bf16 (W8A8: x quantized per
                # row to int8 from 16 rows on).
                torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * scale, msg=f"{name} at {rows}")
            else:
                torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4 * scale, msg=f"{name} at {rows}")
    return set(makers)


@needs_kernels
@pytest.mark.parametrize("mode", ["auto", "bf16"])
@pytest.mark.parametrize(("fmt", "group"), FORMATS, ids=[f"{f}-g{g}" for f, g in FORMATS])
def test_every_kernel_path_against_a_float_reference(fmt: str, group: int, mode: str, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", mode)
    weight = _weight(fmt, 40, 128, group)  # 40 columns: a partial last panel
    names = _check(weight, kernel_choice.candidates(weight))
    assert any(is_dense(name) for name in names)


@needs_kernels
def test_default_dense_copies_keep_float32_activations(monkeypatch) -> None:
    """By default every candidate computes in float32, so a request's greedy tokens do not depend on the batch
    size that picks the kernel; bf16 copies (activations rounded to bf16) only when asked for."""
    weight = _weight("int8", 40, 128, 32)
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "auto")
    assert [n for n in kernel_choice.candidates(weight) if is_dense(n)] == ["dense-f32/blas"]
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "bf16")
    bf16 = [n for n in kernel_choice.candidates(weight) if is_dense(n)]
    if platform_for(torch.device("cpu")).onednn_bf16() and cpu_isa() != ISA_CODES["avx2"]:
        assert "dense-bf16/onednn" in bf16 and "dense-f32/blas" not in bf16
    x = torch.randn(64, 128)
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "auto")
    copy, isa = kernel_choice.candidates(weight)["dense-f32/blas"]()
    torch.testing.assert_close(copy.bind(isa)(x, None, None), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_lm_head_shape_runs_copies_with_float32_results_only() -> None:
    weight = _weight("int8", 1000, 576, 32)  # SmolLM2's head is 49152 x 576, int8 g32 from the Q8_0 embedding
    makers = kernel_choice.candidates(weight, exact_output=True)
    dense = [name for name in makers if is_dense(name)]
    assert dense in (["dense-bf16/panels"], ["dense-f32/blas"])  # never a kernel that rounds logits to bf16
    _check(weight, makers, (1, 17, 256))
    if dense == ["dense-bf16/panels"]:  # float32 sums of the bf16-rounded products, written unrounded
        copy, isa = makers["dense-bf16/panels"]()
        x = torch.randn(5, 576)
        expected = x.bfloat16().float() @ weight.dequantize().bfloat16().float().T
        torch.testing.assert_close(copy.bind(isa)(x, None, None), expected, rtol=1e-5, atol=1e-4)


def test_dense_copies_follow_the_setting_and_the_memory_budget(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "off")
    assert dense_copies_allowed(1)[0] is False
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "on")
    assert dense_copies_allowed(10**15, available=10**9)[0] is True
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "auto")
    assert dense_copies_allowed(2 * 10**8, available=10**9)[0] is True
    allowed, why = dense_copies_allowed(3 * 10**8, available=10**9)
    assert not allowed and "quarter" in why


@needs_kernels
def test_dense_copies_off_leaves_the_quantized_candidates(monkeypatch) -> None:
    weight = _weight("int8", 40, 128, 32)
    assert not any(is_dense(n) for n in kernel_choice.candidates(weight, dense=False))
    layer = _layer("int8", 32)
    monkeypatch.setenv("PAGEDLLM_CPU_DENSE_COPY", "off")
    kernel_choice.autotune_model(LayersModel([layer]), "on", lambda kernel, x: 1.0)
    path = autotune.default_path()  # none where one ISA is left (PAGEDLLM_CPU_ISA=avx2): nothing to choose
    entries = json.loads(path.read_text())["entries"] if path.exists() else {}
    assert not any(is_dense(name) for entry in entries.values() for name in entry["ms"])


def _layer(fmt: str, group: int, prefix: str = "", n: int = 40) -> Linear:
    layer = Linear(128, n, bias=True, quant_config=Int8Config(), prefix=prefix)
    layer.bias.data.normal_()
    layer.bind_weight(_weight(fmt, n, 128, group))
    return layer


@needs_kernels
def test_a_recorded_table_runs_the_dense_copy_for_many_rows_only(tmp_path, monkeypatch) -> None:
    layer = _layer("int8", 32)
    weight = layer.qpanels
    dense = next(name for name in kernel_choice.candidates(weight) if is_dense(name))
    own = next(name for name in kernel_choice.candidates(weight) if not is_dense(name))
    choices = [own, own, own, dense, dense]
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps({"entries": {kernel_choice.shape_key(weight): {"choices": choices}}}))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", str(forced))
    runs = []
    real = dense_copy.DenseCopy.bind

    def counting_bind(self, isa=None):
        kernel = real(self, isa)
        return lambda x, bias, out: runs.append(x.shape[0]) or kernel(x, bias, out)

    monkeypatch.setattr(dense_copy.DenseCopy, "bind", counting_bind)
    kernel_choice.autotune_model(LayersModel([layer]), "on", lambda kernel, x: 1 / 0)
    assert layer.qpanels is weight  # the quantized weight stays the layer's (few rows run it)
    reference = weight.dequantize()
    for rows in ROWS:
        x = torch.randn(rows, 128)
        expected = x @ reference.T + layer.bias
        torch.testing.assert_close(layer(x), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    assert runs == [64, 256]  # buckets 33-128 and 129+


@needs_kernels
def test_the_lm_head_is_tuned_apart_and_says_what_it_kept(caplog) -> None:
    head, hidden = _layer("int8", 32, prefix="lm_head"), _layer("int8", 32, prefix="model.layers.0.mlp.up_proj")

    def timer(kernel, x):  # the dense copy wins from 33 rows on
        dense = kernel.__name__.startswith("dense") or kernel.__name__ == "blas"  # DenseCopy.bind's kernels
        return 0.5 if dense == (x.shape[0] >= 64) else 1.0

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        kernel_choice.autotune_model(LayersModel([head, hidden]), "on", timer)
    entries = json.loads(autotune.default_path().read_text())["entries"]
    assert len(entries) == 2  # same shape, but the head has its own entry: float32 copies only
    head_entry = next(e for k, e in entries.items() if k.endswith(":head"))
    (dense,) = {name for name in head_entry["choices"][3:]}
    assert is_dense(dense) and "dense-bf16/onednn" not in head_entry["ms"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("LM head"))
    assert f"copy ({dense}) from 33 rows" in line and "for 1-32 rows" in line


@needs_kernels
def test_the_lm_head_may_take_its_dense_copy_at_any_row_count() -> None:
    head = _layer("int8", 32, prefix="lm_head")
    hidden = _layer("int8", 32, prefix="model.layers.0.mlp.up_proj")

    def timer(kernel, x):  # the dense copy faster everywhere
        return 0.1 if kernel.__name__.startswith("dense") or kernel.__name__ == "blas" else 1.0

    kernel_choice.autotune_model(LayersModel([head, hidden]), "on", timer)
    entries = json.loads(autotune.default_path().read_text())["entries"]
    for key, entry in entries.items():
        dense_buckets = [b for b, name in enumerate(entry["choices"]) if is_dense(name)]
        # The head's logits are computed after the CPU step graph; hidden layers run inside it up to 32 rows.
        assert dense_buckets == ([0, 1, 2, 3, 4] if key.endswith(":head") else [3, 4])


def test_suspicious_buckets_flag_work_that_disagrees_with_its_neighbours() -> None:
    assert autotune.suspicious_buckets([0.1, 0.12, 0.2, 0.5, 1.8]) == []
    assert autotune.suspicious_buckets([0.1, 0.12, 0.9, 0.25, 0.9]) == [2]  # 16 rows cost 3.6x 64 rows
    assert autotune.suspicious_buckets([0.1, 0.12, 0.2, 0.25, 3.0]) == [4]  # a row at 256 costs 3x one at 64


def test_a_disturbed_bucket_is_measured_again() -> None:
    calls: dict[int, int] = {}
    a, b = (lambda x, bias, out: x), (lambda x, bias, out: x)

    def timer(kernel, x):
        rows = x.shape[0]
        calls[rows] = calls.get(rows, 0) + 1
        burst = rows == 16 and calls[rows] <= 10  # the first measurement of bucket 16 hit by other work
        return (10.0 if burst else 1.0) * (1 + rows / 16) * 1e-4

    choices, timings = autotune.choose({"a": a, "b": b}, 4, timer)
    assert calls[16] > 10 and calls[16] > calls[4]  # only the disturbed bucket ran again
    assert timings["a"][2] == pytest.approx(2e-4)


def test_busy_entries_are_refreshed_when_the_machine_is_quiet(monkeypatch) -> None:
    layer = _layer("int8", 32) if KERNELS is not None else None
    if layer is None:
        pytest.skip("the C++ CPU kernels did not build here")
    timed = []

    def timer(kernel, x):
        timed.append(x.shape[0])
        return 1.0

    monkeypatch.setattr(autotune, "other_load", lambda before, after: 0.9)  # measured while others were busy
    kernel_choice.autotune_model(LayersModel([layer]), "on", timer)
    (entry,) = json.loads(autotune.default_path().read_text())["entries"].values()
    assert entry["busy"] and entry["load"] == 0.9 and entry["measured"]
    monkeypatch.setattr(autotune, "other_load", lambda before, after: 0.0)
    timed.clear()
    monkeypatch.setattr(autotune, "load_now", lambda seconds=0.25: 0.8)  # still busy: kept
    kernel_choice.autotune_model(LayersModel([_layer("int8", 32)]), "on", timer)
    assert timed == []
    monkeypatch.setattr(autotune, "load_now", lambda seconds=0.25: 0.0)  # quiet: measured again
    kernel_choice.autotune_model(LayersModel([_layer("int8", 32)]), "on", timer)
    assert timed
    (entry,) = json.loads(autotune.default_path().read_text())["entries"].values()
    assert not entry["busy"]


def test_other_load_subtracts_this_process() -> None:
    # 2 CPUs for 1 s: 2 CPU-seconds elapsed; 1.5 busy, 1.0 of them this process's -> others kept 25% busy.
    assert autotune.other_load((10.0, 100.0, 5.0), (11.5, 102.0, 6.0)) == pytest.approx(0.25)
    assert autotune.other_load((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)) == 0.0
    # Two 10 ms ticks of someone else's work in a 20 ms window is tick rounding, not a busy machine.
    assert autotune.other_load((10.0, 100.0, 5.0), (10.02, 100.02, 5.0)) == 0.0


def test_bench_kernels_prints_the_table(tmp_path, capsys) -> None:
    table = autotune.AutotuneTable(tmp_path / "t.json", autotune.fingerprint("k"))
    table.record("Int8Panels:576x576:g32", ["panels/avx512"] * 3 + ["dense-bf16/onednn"] * 2,
                 {"panels/avx512": [1e-4, 2e-4, 4e-4, 1.6e-3, 6.4e-3],
                  "dense-bf16/onednn": [2e-4, 3e-4, 5e-4, 1.0e-3, 3.2e-3]}, load=0.5)
    table.save()
    import argparse

    result = bench_kernels.main(argparse.Namespace(table=tmp_path / "t.json", json=False))
    text = capsys.readouterr().out
    assert "Int8Panels:576x576:g32" in text and "129+" in text and "dense-bf16/onednn" in text
    assert "[busy]" in text and "others kept 50%" in text
    assert [r["chosen"] for r in result["rows"]][-1] == "dense-bf16/onednn"
    assert result["rows"][-1]["ms"] == {"panels/avx512": 6.4, "dense-bf16/onednn": 3.2}


def test_dense_copies_are_chosen_for_many_rows_only() -> None:
    own, dense = (lambda x, bias, out: x), (lambda x, bias, out: x)
    seconds = {id(own): 1.0, id(dense): 0.1}  # the copy faster everywhere
    choices, timings = autotune.choose({"own": own, "dense-bf16/onednn": dense}, 4, lambda k, x: seconds[id(k)],
                                       first_bucket={"dense-bf16/onednn": dense_copy.DENSE_FIRST_BUCKET})
    assert choices == ["own"] * 3 + ["dense-bf16/onednn"] * 2  # step-graph batches keep the quantized kernels
    assert timings["dense-bf16/onednn"][0] == pytest.approx(0.1)  # still timed (the log shows it)
