"""`LLMEngine`: the synchronous engine. One `step()` is schedule -> execute -> update."""

from __future__ import annotations

import logging

from pagoda.config import EngineArgs
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.core.stats import SchedulerStats
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.processor import Processor, PromptType
from pagoda.model_executor.model_loader import load_tokenizer
from pagoda.outputs import RequestOutput
from pagoda.request import RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        if engine_args.num_threads is not None:
            import torch

            torch.set_num_threads(engine_args.num_threads)
        self.engine_args = engine_args
        self.model_config = model_config = engine_args.create_model_config()
        self.cache_config = cache_config = engine_args.create_cache_config()
        self.tokenizer = load_tokenizer(model_config.path, model_config.is_gguf)
        self.model_runner = ModelRunner(model_config, cache_config)
        num_blocks = self.model_runner.num_blocks
        capacity = num_blocks * cache_config.block_size
        max_model_len = model_config.max_model_len
        if max_model_len > capacity:
            if not model_config.max_model_len_is_default:
                raise ValueError(
                    f"max_model_len ({max_model_len}) is larger than the KV cache holds "
                    f"({capacity} tokens); raise kv_cache_memory_bytes or lower max_model_len."
                )
            logger.warning(
                "max_model_len lowered from %d to the KV cache's %d tokens.",
                max_model_len,
                capacity,
            )
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler_config = engine_args.create_scheduler_config(max_model_len)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            num_host_blocks=self.model_runner.num_host_blocks,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.processor = Processor(self.tokenizer, model_config, max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        logger.info(
            "pagoda engine: model %s (%s, %s), KV cache %d blocks x %d tokens = %d tokens in flight, "
            "max_model_len %d",
            model_config.model,
            model_config.architecture,
            model_config.dtype,
            num_blocks,
            cache_config.block_size,
            capacity,
            max_model_len,
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError (naming the field) on bad input.

        With `params.n > 1` the request runs as n children that share the
        prompt's blocks; its RequestOutput carries n completions.
        """
        if request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        children, text = self.processor.process(request_id, prompt, params, priority, arrival_time)
        self.output_processor.add_request(request_id, children, text)
        self.scheduler.add_request(children[0], fork_siblings=children[1:])

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort requests by id, freeing their blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        child_ids = [cid for rid in ids for cid in self.output_processor.child_ids(rid)]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort_requests(ids)

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the outputs of requests that progressed."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.model_runner.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def get_stats(self) -> SchedulerStats:
        """Running/waiting counts, preemptions, token counters and the KV cache's state."""
        return self.scheduler.get_stats()

    def get_tokenizer(self):
        return self.tokenizer
