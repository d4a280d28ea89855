"""The CPU kernel autotuner: buckets, the table's life (saved, reloaded, stale, forced), choices by (fake)
timings, and candidates that agree, so a choice changes speed only."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from pagedllm.kernels import autotune
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.model_executor.layers.quantization.dense_copy import is_dense
from pagedllm.model_executor.layers.quantization.qpanels import (
    QPanels,
    quantize_f8,
    quantize_q4,
    quantize_q8,
)
from pagedllm.model_executor.layers.quantization.weight_only import Int4Config
from pagedllm.platforms import platform_for

from helpers.autotune import LayersModel, use_own_autotune_cache

KERNELS = platform_for(torch.device("cpu")).cpu_kernels(torch.float32)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    use_own_autotune_cache(tmp_path, monkeypatch)


def test_bucket_edges() -> None:
    assert [autotune.bucket_index(m) for m in (1, 2, 3, 8, 9, 32, 33, 128, 129, 5000)] == [0, 0, 1, 1, 2, 2, 3, 3,
                                                                                             4, 4]
    assert len(autotune.BUCKET_ROWS) == 5


def test_by_rows_runs_each_buckets_choice() -> None:
    calls = []

    def tag(name):
        return lambda x, bias, out: calls.append(name) or x

    a, b = tag("a"), tag("b")
    assert autotune.by_rows([a] * 5) is a  # one choice everywhere: no dispatch at all
    run = autotune.by_rows([a, a, b, b, b])
    for rows in (1, 8, 9, 300):
        run(torch.zeros(rows, 2), None, None)
    assert calls == ["a", "a", "b", "b"]


def test_choose_keeps_the_fastest_per_bucket() -> None:
    speed = {"slow_small": lambda rows: 1.0 if rows < 16 else 0.1, "fast_small": lambda rows: 0.5}
    cands = {name: (lambda x, bias, out: x) for name in speed}

    def timer(kernel, x):
        name = next(n for n, k in cands.items() if k is kernel)
        return speed[name](x.shape[0])

    choices, timings = autotune.choose(cands, 8, timer)
    assert choices == ["fast_small", "fast_small", "slow_small", "slow_small", "slow_small"]
    assert timings["fast_small"] == [0.5] * 5


def test_the_packings_own_kernel_stays_unless_clearly_beaten() -> None:
    own, other = (lambda x, bias, out: x), (lambda x, bias, out: x)
    seconds = {id(own): 1.0, id(other): 0.97}  # 3% faster: noise, not worth a second copy of a weight
    choices, _ = autotune.choose({"own": own, "other": other}, 4, lambda k, x: seconds[id(k)])
    assert choices == ["own"] * 5
    seconds[id(other)] = 0.8
    choices, _ = autotune.choose({"own": own, "other": other}, 4, lambda k, x: seconds[id(k)])
    assert choices == ["other"] * 5


def test_rounds_alternate_and_keep_each_candidates_median() -> None:
    calls = []
    # Other work hits A's first call and every third call of both: the median is the undisturbed time.
    noisy = itertools.chain([9.0, 1.0], itertools.cycle([1.0, 2.0, 1.0, 1.0, 9.0, 1.0]))
    a, b = (lambda x, bias, out: x), (lambda x, bias, out: x)

    def timer(kernel, x):
        calls.append("a" if kernel is a else "b")
        return next(noisy) * 1e-4

    _, timings = autotune.choose({"a": a, "b": b}, 4, timer)
    assert calls[:4] == ["a", "b", "a", "b"]  # in turns
    assert timings["a"][0] == pytest.approx(1e-4) and timings["b"][0] == pytest.approx(1e-4)


def test_table_saves_reloads_and_ignores_another_machine(tmp_path) -> None:
    fp = autotune.fingerprint("k1")
    table = autotune.AutotuneTable(tmp_path / "t.json", fp)
    table.record("Q:1x2:g32", ["a"] * 5, {"a": [0.001] * 5})
    table.save()
    again = autotune.AutotuneTable(tmp_path / "t.json", fp)
    again.load()
    assert again.choices("Q:1x2:g32") == ["a"] * 5 and not again.stale
    other = autotune.AutotuneTable(tmp_path / "t.json", {**fp, "cpu": "another CPU"})
    other.load()
    assert other.stale and other.choices("Q:1x2:g32") is None
    rebuilt = autotune.AutotuneTable(tmp_path / "t.json", autotune.fingerprint("k2"))  # other kernels build
    rebuilt.load()
    assert rebuilt.stale


def _q4_linear(n: int = 40, k: int = 64, layout: str = "dot8", seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=True, quant_config=Int4Config(32))
    layer.bias.data.normal_()
    layer.bind_weight(QPanels.pack_q4(*quantize_q4(torch.randn(n, k), 32), layout))  # as layer.qpanels
    return layer


def _weights() -> list[QPanels]:
    torch.manual_seed(1)
    w = torch.randn(37, 64)  # 37 columns: a partial last panel (the tile tail)
    q, scales, mins = quantize_q4(w, 32)
    exact = scales.half().float(), mins.half().float()  # GGUF's Q4 blocks store float16 scales: dot8 keeps them
    return [QPanels.pack_q4(q, *exact, "dot8"), QPanels.pack_q4(q, *exact, "pairs"),
            QPanels.pack_q8(*quantize_q8(w, 32)), QPanels.pack_f8(*quantize_f8(w, 32))]


@needs_kernels
@pytest.mark.parametrize("index", range(4), ids=["q4-dot8", "q4-pairs", "int8", "fp8"])
def test_every_candidate_computes_the_same_product(index: int) -> None:
    weight = _weights()[index]
    reference = weight.dequantize()
    bias = torch.randn(weight.out_features)
    makers = kernel_choice.candidates(weight)
    assert makers, "no candidates"
    if weight.layout == "dot8":
        assert {name.split("/")[0] for name in makers if not is_dense(name)} == {"dot8", "pairs"}
    assert any(is_dense(name) for name in makers)  # the many-rows candidate (dense_copy.py)
    for rows in (1, 3, 17, 70):  # row tails of every tile height
        x = torch.randn(rows, weight.in_features)
        expected = x @ reference.T + bias
        for name, make in makers.items():
            packed, isa = make()
            got = packed.bind(isa)(x, bias, None)
            if name.startswith("dense-bf16"):  # the bf16-rounded product (tests/quantization/test_dense_copy.py)
                expected_bf16 = x.bfloat16().float() @ reference.bfloat16().float().T + bias
                torch.testing.assert_close(got, expected_bf16, rtol=4e-3, atol=4e-3 * expected.abs().max().item(),
                                           msg=f"{name} at {rows} rows")
                continue
            torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4 * expected.abs().max().item(),
                                       msg=f"{name} at {rows} rows")


@needs_kernels
def test_autotune_binds_per_bucket_and_results_stay_equal(monkeypatch) -> None:
    layers = [_q4_linear(seed=s) for s in range(3)]  # one shape class: measured once
    x_by_rows = {rows: torch.randn(rows, 64) for rows in (1, 4, 16, 64, 300)}
    before = {rows: [layer(x) for layer in layers] for rows, x in x_by_rows.items()}
    timed = []

    def timer(kernel, x):
        timed.append(x.shape[0])
        name = names.get(id(kernel))
        if name is None:  # a dense copy (test_dense_copy.py): slower here
            return 2.0
        small = x.shape[0] < 16
        return 1.0 if (name.startswith("dot8") != small) else 0.5  # dot8 wins small, pairs wins large

    names: dict[int, str] = {}
    real_bind = QPanels.bind

    def naming_bind(self, isa=None):
        kernel = real_bind(self, isa)
        names[id(kernel)] = f"{self.layout}/{isa}"
        return kernel

    monkeypatch.setattr(QPanels, "bind", naming_bind)
    model = LayersModel(layers)
    kernel_choice.autotune_model(model, "on", timer)
    isas = len(kernel_choice._isas(KERNELS))
    # Five buckets x two layouts x ISAs, for the one shape class, in turns of at least 2 rounds.
    assert sorted(set(timed)) == list(autotune.BUCKET_ROWS) and len(timed) >= 5 * 2 * 2 * isas
    saved = json.loads(autotune.default_path().read_text())
    (entry,) = saved["entries"].values()
    assert [c.split("/")[0] for c in entry["choices"]] == ["dot8", "dot8", "pairs", "pairs", "pairs"]
    for rows, x in x_by_rows.items():
        for layer, expected in zip(layers, before[rows]):
            torch.testing.assert_close(layer(x), expected, rtol=2e-4, atol=2e-4 * expected.abs().max().item())
    assert all(layer.qpanels.layout == "dot8" for layer in layers)  # the few-row layout stays the weight

    # A second model of the same shapes reads the saved table: nothing is timed again; "force" times again.
    timed.clear()
    kernel_choice.autotune_model(LayersModel([_q4_linear(seed=9)]), "on", timer)
    assert timed == []
    kernel_choice.autotune_model(LayersModel([_q4_linear(seed=9)]), "force", timer)
    assert len(timed) >= 5 * 2 * 2 * isas


@needs_kernels
def test_one_layout_everywhere_keeps_only_that_copy() -> None:
    layer = _q4_linear(layout="dot8")
    original = layer.qpanels
    kernel_choice.autotune_model(LayersModel([layer]), "on", lambda kernel, x: 1.0)  # ties: the first candidate
    assert layer.qpanels is original  # dot8 everywhere: no second copy made


@needs_kernels
def test_a_forced_table_decides_and_is_never_written(tmp_path, monkeypatch) -> None:
    layer = _q4_linear(layout="dot8")
    isa = kernel_choice.ISA_NAMES[kernel_choice._isas(KERNELS)[0]]
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps({"entries": {kernel_choice.shape_key(layer.qpanels): {
        "choices": [f"pairs/{isa}"] * 5}}}))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", str(forced))
    x = torch.randn(3, 64)
    expected = layer(x)

    def never(kernel, x):
        raise AssertionError("a forced table is not measured")

    kernel_choice.autotune_model(LayersModel([layer]), "on", never)
    assert layer.qpanels.layout == "pairs"  # pairs everywhere: only that copy is kept
    torch.testing.assert_close(layer(x), expected, rtol=2e-4, atol=2e-4 * expected.abs().max().item())
    assert not autotune.default_path().exists()


def test_off_and_bad_modes() -> None:
    layer = _q4_linear()
    kernel = layer.packed.cpu_matmul()
    kernel_choice.autotune_model(LayersModel([layer]), "off", lambda kernel, x: 1 / 0)
    assert layer.packed.cpu_matmul() is kernel
    with pytest.raises(ValueError, match="cpu_kernel_autotune"):
        kernel_choice.autotune_model(LayersModel([layer]), "sometimes")


def _float_linear(seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(64, 40, bias=True)
    layer.bias.data.normal_()
    layer.process_weights_after_loading()  # float32 panels for the C++ kernel
    return layer


@needs_kernels
@pytest.mark.parametrize("blas_from", [2, 0], ids=["mixed", "blas-everywhere"])
def test_float32_panels_against_blas(blas_from: int) -> None:
    layer = _float_linear()
    assert layer.packed.panels is not None
    xs = [torch.randn(rows, 64) for rows in (1, 5, 20, 100, 300)]
    expected = [layer(x) for x in xs]

    def timer(kernel, x):
        blas = kernel.__name__ == "blas"
        return 0.5 if blas == (autotune.bucket_index(x.shape[0]) >= blas_from) else 1.0

    kernel_choice.autotune_model(LayersModel([layer]), "on", timer)
    (entry,) = json.loads(autotune.default_path().read_text())["entries"].values()
    assert entry["choices"] == ["panels"] * blas_from + ["blas"] * (5 - blas_from)
    for x, want in zip(xs, expected):
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.unsqueeze(0)), want.unsqueeze(0), rtol=1e-5, atol=1e-5)  # 3-D path
    if blas_from == 0:
        assert layer.packed.panels is None and layer.packed.rows is not None  # one copy: the plain weight
    else:
        assert layer.packed.panels is not None
