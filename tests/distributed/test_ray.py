"""Ray on a local ``ray.init(num_cpus=2)``: a TP=2 engine whose rank 1 is a Ray actor in a placement group equals
TP=1, and two data-parallel engine cores as Ray actors (``--data-parallel-backend ray``) answer as one engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers.tp_helpers import PROMPTS, greedy, tiny

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")  # pagedllm[ray], installed by `make test` through .[test]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_tp2_and_ray_dp2_equal_one_engine(local_ray, tmp_path) -> None:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.mp_engine import MultiprocEngine
    from pagedllm.engine_args import EngineArgs
    from pagedllm.sampling_params import SamplingParams

    path = tiny("LlamaForCausalLM", tmp_path)
    want = greedy(path, 1)
    assert greedy(path, 2, distributed_executor_backend="ray") == want
    assert not local_ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in local_ray.util.placement_group_table().values())

    config = EngineArgs(model=path, kv_cache_memory="16MiB", max_model_len=128, dtype="float32",
                        data_parallel_size=2, data_parallel_backend="ray",
                        data_parallel_routing="round-robin").create_engine_config()
    start = time.monotonic()
    engine = MultiprocEngine(config)
    started = time.monotonic() - start
    llm = AsyncLLM(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(i: int) -> list[int]:
        ids: list[int] = []
        async for out in llm.generate({"prompt_token_ids": PROMPTS[i]}, params, f"r{i}"):
            ids += out.outputs[0].token_ids
        return ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])

    try:
        from pagedllm.executor.ray_utils import ActorCall

        handles = engine.client.processes
        assert len(handles) == 2 and all(isinstance(h, ActorCall) and h.is_alive() for h in handles)
        assert asyncio.run(main()) == want
    finally:
        llm.shutdown(5.0)
    assert started < 120
