"""CPU step graphs (worker/cpu_graphs.py): decode and draft-verification steps replayed from recorded C++ kernel
calls give the tokens an eager engine gives; a forward that computes outside the kernels, or whose replay differs
from an eager forward, is refused and runs eagerly (from the first batch size where it does)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.worker.cpu_graphs import CPU_GRAPH_SIZES, CpuDecodeGraphRunner, cpu_graph_sizes, verification_graph_sizes
from pagedllm.worker.cuda_graphs import uniform_query_len


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None, "the C++ CPU kernels must build on the test machine"
    return k


def _runner(model, kernels) -> CpuDecodeGraphRunner:
    return CpuDecodeGraphRunner(model, kernels, max_blocks_per_seq=4, block_size=16, hidden_size=8,
                                dtype=torch.float32, sizes=[1, 3])


def test_a_kernel_only_forward_records_and_replays_new_inputs(kernels) -> None:
    table = torch.randn(20, 8)
    w = torch.randn(8)
    graphs = _runner(lambda ids, pos: kernels.rms_norm(kernels.embedding_rows(table, ids), w, 1e-6), kernels)
    assert graphs.capture() and set(graphs.graphs) == {1, 3}
    assert graphs.graphs[3].num_ops == 2 and graphs.graphs[3].broken == ""
    graphs.input_ids[:3] = torch.tensor([7, 2, 19])
    graphs.graphs[3].replay()
    assert torch.equal(graphs.outputs[3], kernels.rms_norm(table[[7, 2, 19]], w, 1e-6))


def test_profile_times_each_recorded_call_and_computes_what_replay_does(kernels) -> None:
    """StepGraph.profile (how docs/performance.md splits a real step by kernel): one (kernel, seconds) per recorded
    call, in order, and the same outputs as a replay."""
    table = torch.randn(20, 8)
    w = torch.randn(8)
    graphs = _runner(lambda ids, pos: kernels.rms_norm(kernels.embedding_rows(table, ids), w, 1e-6), kernels)
    assert graphs.capture()
    graphs.input_ids[:3] = torch.tensor([4, 11, 0])
    timed = graphs.graphs[3].profile(5)
    assert [name for name, _ in timed] == ["embedding_rows", "rms_norm"]
    assert all(seconds > 0 for _, seconds in timed)
    assert torch.equal(graphs.outputs[3], kernels.rms_norm(table[[4, 11, 0]], w, 1e-6))


def test_a_torch_op_outside_the_kernels_refuses_the_capture(kernels, caplog) -> None:
    table = torch.randn(20, 8)
    graphs = _runner(lambda ids, pos: kernels.embedding_rows(table, ids) * 2, kernels)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert not graphs.capture()
    assert not graphs.graphs and "torch op mul" in caplog.text and "run eagerly" in caplog.text


def test_a_bigger_batch_refused_keeps_the_smaller_graphs(kernels, caplog) -> None:
    """A forward that leaves the kernels only from 3 rows on (as a bf16 model whose autotuner gives a matmul to
    oneDNN above some row count): sizes 1 and 2 replay, batches of 3 or more run eagerly."""
    table = torch.randn(20, 8)

    def model(ids, pos):
        x = kernels.embedding_rows(table, ids)
        return x * 2 if ids.shape[0] > 2 else x

    graphs = CpuDecodeGraphRunner(model, kernels, max_blocks_per_seq=4, block_size=16, hidden_size=8,
                                  dtype=torch.float32, sizes=[1, 2, 3, 4])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert graphs.capture()
    assert set(graphs.graphs) == set(graphs.outputs) == {1, 2} and graphs.sizes == [1, 2]
    assert "stop at batch 2" in caplog.text and "torch op mul" in caplog.text
    two = AttentionMetadata.for_step([1, 1], [10, 10], [[1], [2]], 16)
    assert graphs.can_run(two)
    assert not graphs.can_run(AttentionMetadata.for_step([1, 1, 1], [10, 10, 10], [[1], [2], [3]], 16))
    ids = torch.tensor([5, 17])
    assert torch.equal(graphs.run(ids, torch.tensor([9, 9]), two), table[ids])


def test_a_kernel_result_no_replay_refills_refuses_the_capture(kernels, caplog) -> None:
    # encoder_attention allocates its result and takes no out: a replay would not write where Python reads.
    table = torch.randn(20, 8)

    def model(ids, pos):
        x = kernels.embedding_rows(table, ids).view(-1, 2, 4)
        return kernels.encoder_attention(x, x, x, torch.tensor([0, ids.shape[0]], dtype=torch.int32), 0.5)

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert not _runner(model, kernels).capture()
    assert "encoder_attention returns a tensor" in caplog.text


def test_a_replay_that_differs_from_eager_is_refused(kernels, caplog) -> None:
    # The table is chosen in Python per call: the recording froze the first, the eager check reads the next.
    tables = iter(torch.randn(8, 20, 8))
    graphs = _runner(lambda ids, pos: kernels.embedding_rows(next(tables), ids), kernels)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert not graphs.capture()
    assert "differs from the eager forward" in caplog.text and not graphs.graphs


def test_a_forward_that_fails_while_recording_leaves_the_engine_eager(kernels, caplog) -> None:
    def model(ids, pos):
        raise ValueError("no such layer")

    graphs = _runner(model, kernels)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert not graphs.capture()
    assert "no such layer" in caplog.text and not graphs.graphs
    kernels.begin_step_graph()  # the failed recording was ended: a new one may start
    kernels.end_step_graph()


def test_recording_twice_on_a_thread_is_an_error(kernels) -> None:
    kernels.begin_step_graph()
    try:
        with pytest.raises(RuntimeError, match="already recording"):
            kernels.begin_step_graph()
    finally:
        kernels.end_step_graph()
    with pytest.raises(RuntimeError, match="no step graph is recording"):
        kernels.end_step_graph()


PROMPTS = ["The capital of France is", "1 2 3 4", "def fibonacci(n):", "Once upon a time", "a", "Water boils at",
           "The best way to learn", "In 1969", "Hello, my name is", "Rust or C++?"]


def test_engine_tokens_equal_with_and_without_step_graphs() -> None:
    """Ten requests of different lengths: steps of 9 or 10 decodes replay the size-12 graph with padding rows,
    then the batch shrinks through every recorded size up to 8 (requests stop at different lengths)."""
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    runs = {}
    for eager in (True, False):
        llm = LLM(enforce_eager=eager)
        runner = llm.engine.core.worker.runner
        assert (runner.decode_graphs is None) == eager
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        alone = llm.generate(PROMPTS[:1], params[:1])[0].outputs[0].token_ids  # batch 1: the size-1 graph
        assert alone == runs[eager][0]
        del llm
    assert runs[False] == runs[True]
    assert [len(t) for t in runs[False]] == [p.max_tokens for p in params]


def test_recorded_sizes_cover_every_batch_the_engine_can_run() -> None:
    assert cpu_graph_sizes(256) == CPU_GRAPH_SIZES == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
    assert cpu_graph_sizes(10) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert cpu_graph_sizes(12) == [1, 2, 3, 4, 5, 6, 7, 8, 12]
    assert cpu_graph_sizes(3) == [1, 2, 3]


def test_verification_sizes_stay_within_their_token_cap() -> None:
    assert verification_graph_sizes(256, 2) == [1, 2, 3, 4]
    assert verification_graph_sizes(256, 4) == [1, 2]
    assert verification_graph_sizes(256, 5) == [1]
    assert verification_graph_sizes(3, 2) == [1, 2, 3]
    assert verification_graph_sizes(256, 9) == []


def test_a_uniform_multi_token_step_records_and_replays_like_its_eager_forward(kernels) -> None:
    """Three tokens per request: the buffers hold size x 3 tokens, the offsets step by 3, dummy rows are whole."""
    table = torch.randn(20, 8)
    w = torch.randn(8)
    graphs = CpuDecodeGraphRunner(lambda ids, pos: kernels.rms_norm(kernels.embedding_rows(table, ids), w, 1e-6),
                                  kernels, max_blocks_per_seq=4, block_size=16, hidden_size=8, dtype=torch.float32,
                                  sizes=[1, 2], query_len=3)
    assert graphs.capture() and set(graphs.graphs) == {1, 2}
    assert graphs.query_start_loc.tolist() == [0, 3, 6] and graphs.seq_lens.tolist() == [3, 3]
    meta = graphs._metadata(2)
    assert meta.query_start_loc_cpu == [0, 3, 6] and meta.num_decodes == 0 and meta.num_actual_tokens == 6
    step = AttentionMetadata.for_step([3], [10], [[1]], 16)  # one request verifying two drafts
    assert graphs.can_run(step) and uniform_query_len(step) == 3
    ids = torch.tensor([4, 9, 13])
    hidden = graphs.run(ids, torch.arange(7, 10), step)
    assert hidden.shape == (3, 8) and torch.equal(hidden, kernels.rms_norm(table[ids], w, 1e-6))
    assert graphs.input_ids[3:].tolist() == [0, 0, 0] and graphs.seq_lens.tolist() == [10, 3]
    mixed = AttentionMetadata.for_step([2, 3], [10, 10], [[1], [2]], 16)
    assert uniform_query_len(mixed) is None and not graphs.can_run(mixed)
    assert uniform_query_len(AttentionMetadata.for_step([1, 3], [10, 10], [[1], [2]], 16)) is None
    assert not graphs.can_run(AttentionMetadata.for_step([1], [10], [[1]], 16))


def test_speculation_replays_verification_graphs_and_keeps_the_tokens() -> None:
    """ngram drafts on a repetitive prompt: steps verifying 1..3 drafts replay their own graphs, and the greedy
    tokens equal an eager engine's without speculation."""
    prompts = ["1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3", "a b c a b c a b c a b c a b"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eager = LLM(enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    del eager
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "auto_disable": False})
    graphs = llm.engine.core.worker.runner.decode_graphs
    assert set(graphs.by_query_len) == {1, 2, 3, 4}
    replays = {q: 0 for q in graphs.by_query_len}
    for q, runner in graphs.by_query_len.items():
        def counted(*args, q=q, run=runner.run):
            replays[q] += 1
            return run(*args)
        runner.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert sum(replays[q] for q in (2, 3, 4)) > 0, replays


@pytest.mark.slow
def test_a_bf16_model_replays_the_batches_its_kernels_run(kernels, tmp_path, monkeypatch) -> None:
    """bf16: the kernel autotuner decides which batches record. The C++ bf16 panels up to 8 rows and oneDNN (a torch
    op) above: graphs of 1..8 replay, bigger batches run eagerly, and the greedy tokens equal an eager engine's."""
    from pagedllm.platforms.cpu_probes import onednn_bf16_available

    if not (onednn_bf16_available() and kernels.bf16_gemm_supported()):
        pytest.skip("this CPU has no native bf16 (AVX-512 BF16): its bf16 matmuls are torch ops, which never record")
    choices = ["panels", "panels", "onednn", "onednn", "onednn"]  # buckets of up to 2, 8, 32, 128 rows, more
    shapes = ["960x576", "576x576", "3072x576", "576x1536", "49152x576"]  # the default model's linear layers
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": {f"Bf16:{s}": {"choices": choices} for s in shapes}}))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNEL_AUTOTUNE_TABLE", str(table))
    kw = dict(dtype="bfloat16", quantization="none", kv_cache_memory="64MiB", max_model_len=512,
              cpu_kernel_autotune="on")
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = LLM(enforce_eager=True, **kw)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    del eager
    llm = LLM(**kw)
    runner = llm.engine.core.worker.runner.decode_graphs.by_query_len[1]
    assert runner.sizes == list(range(1, 9))
    replays = []
    run = runner.run
    runner.run = lambda ids, pos, meta: replays.append(meta.num_reqs) or run(ids, pos, meta)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert replays and max(replays) <= 8  # the first decodes (10 requests) ran eagerly
