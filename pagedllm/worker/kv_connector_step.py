"""How a step is bracketed by a KV connector's worker half: loads before the forward, saves after it, then the
report of finished transfers (``distributed/kv_transfer/base.py``)."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.kv_transfer.base import KVConnectorBase_V1


def run_step_with_connector(connector: KVConnectorBase_V1, sched: SchedulerOutput,
                            run: Callable[[], ModelRunnerOutput]) -> ModelRunnerOutput:
    """``run`` is the step itself. A step that raises saves nothing (its K/V may be half-written); the
    connector still reports, on the next step, whatever finished meanwhile."""
    connector.bind_connector_metadata(sched.kv_connector_metadata)
    try:
        connector.start_load_kv()
        result = run()
        connector.wait_for_save()
        result.kv_connector_output = connector.get_finished(sched.finished_req_ids)
        return result
    finally:
        connector.clear_connector_metadata()
