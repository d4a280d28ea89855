"""The engine core: scheduler + worker, one ``step()`` per model forward. Pure busy-loop material."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.logger import init_logger
from pagedllm.worker.worker import Worker

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        config.cache.num_blocks = self.worker.determine_num_blocks()
        self.worker.init_kv_cache(config.cache.num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        # Step statistics, read by the metrics room.
        self.num_steps = 0
        self.last_step_tokens = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """Requests the detokenizer ended on a stop string."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Still tell the runner about finished requests so it drops their state.
            self.worker.execute_model(sched)
            return self.scheduler.update_from_output(sched, ModelRunnerOutput(sampled_token_ids={}))
        try:
            result = self.worker.execute_model(sched)
        except Exception:  # one bad request must not take the engine down; isolate it instead
            logger.exception("model step failed with %d requests in the batch; running them one at a time "
                             "to find the one at fault", len(sched.num_scheduled_tokens))
            return self.scheduler.recover_from_failed_step(sched)
        self.num_steps += 1
        self.last_step_tokens = sched.total_num_scheduled_tokens
        return self.scheduler.update_from_output(sched, result)

    def reset_prefix_cache(self) -> int:
        return self.scheduler.kv.reset_prefix_cache()
