"""`LLMEngine`: the synchronous engine. One `step()` is schedule -> execute -> update."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace

import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_tier import KVTier, fingerprint
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.core.stats import EngineSnapshot, IterationStats, SchedulerStats
from pagoda.core.structured_output import GrammarCompiler
from pagoda.engine.failure_isolation import FailureIsolation, StepInFlight
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.processor import Processor, PromptType
from pagoda.engine_args import EngineArgs
from pagoda.errors import EngineDeadError, InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.model_executor.model_files import load_tokenizer, weights_identity
from pagoda.outputs import RequestOutput
from pagoda.request import SLO, Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.engine_args = engine_args
        self.config = config = engine_args.create_engine_config()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_config = model_config = config.model
        self.cache_config = cache_config = config.cache
        self.lora_config = config.lora
        self.parallel_config = config.parallel
        self.tokenizer = load_tokenizer(model_config.path, model_config.is_gguf)
        if self.parallel_config.world_size > 1:  # the model split across worker processes
            if self.parallel_config.distributed_executor_backend == "ray":
                from pagoda.worker.ray_executor import RayExecutor

                self.model_runner = RayExecutor(
                    model_config,
                    cache_config,
                    config.draft_model,
                    self.parallel_config,
                    config.num_threads,
                )
            else:
                from pagoda.worker.executor import MultiprocExecutor

                self.model_runner = MultiprocExecutor(
                    model_config, cache_config, config.draft_model, self.parallel_config
                )
        else:
            self.model_runner = ModelRunner(
                model_config,
                cache_config,
                self.lora_config,
                config.draft_model,
                device_config=config.device,
            )
        self.kv_tier = None
        try:
            self._build_around_runner()
        except BaseException:
            self.shutdown()  # no worker process outlives a failed start
            raise

    def _build_around_runner(self) -> None:
        config = self.config
        model_config, cache_config = config.model, config.cache
        num_blocks = self.model_runner.num_blocks
        capacity = num_blocks * cache_config.block_size
        max_model_len = model_config.max_model_len
        window = self.model_runner.sliding_window
        # A request alone must fit: all of it, or where every layer slides (blocks behind
        # the window go back), its window and one step's chunk.
        needed = max_model_len
        if window is not None:
            step = min(config.scheduler.max_num_batched_tokens, max_model_len)
            needed = min(max_model_len, window + step + 2 * cache_config.block_size)
        if needed > capacity:
            if not model_config.max_model_len_is_default:
                what = f"max_model_len ({max_model_len})"
                if window is not None:
                    what = f"a request's window and one step's chunk ({needed} tokens)"
                raise ValueError(
                    f"{what} is larger than the KV cache holds ({capacity} tokens); raise "
                    "kv_cache_memory_bytes or lower max_model_len (or max_num_batched_tokens)."
                )
            logger.warning(
                "max_model_len lowered from %d to the KV cache's %d tokens.",
                max_model_len,
                capacity,
            )
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler_config = replace(config.scheduler, max_model_len=max_model_len)
        self.kv_tier = self._open_kv_tier(window)
        # Prefill for another replica: a finished request's answer waits for its blocks'
        # files (the decode replica reads them from the shared tier when it is sent on).
        self.kv_producer = cache_config.kv_role in ("kv_producer", "kv_both")
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            num_host_blocks=self.model_runner.num_host_blocks,
            dtype=self.model_runner.kv_cache_dtype_name,
            bytes_per_token=(
                self.model_runner.bytes_per_block // cache_config.block_size,
                self.model_runner.kv_expanded_bytes_per_token,
            ),
            sliding_window=window,
            tier=self.kv_tier,
        )
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer,
            self.model_runner.vocab_size,
            model_config.eos_token_ids,
            num_threads=torch.get_num_threads(),
        )
        self.scheduler = Scheduler(
            self.scheduler_config, self.kv_cache_manager, self.grammar_compiler
        )
        self.processor = Processor(
            self.tokenizer,
            model_config,
            max_model_len,
            config.limits,
            self.lora_config,
            self.scheduler_config.max_num_batched_tokens,
            SLO(self.scheduler_config.slo_ttft_ms, self.scheduler_config.slo_tpot_ms),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Objects with record(IterationStats), called after each step and abort (metrics).
        self.stat_loggers: list = []
        # Pipeline parallel: as many steps in flight as stages, so none sits idle.
        self._pipeline_depth = self.parallel_config.pipeline_parallel_size
        self._steps_in_flight: deque[StepInFlight] = deque()
        self.failures = FailureIsolation(
            self.scheduler, self.output_processor, self._steps_in_flight
        )
        self._loras_to_remove: set[int] = set()  # removed while requests still used them
        self._step_started = time.monotonic()  # the step's wall time feeds the cost estimate
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

    def _open_kv_tier(self, window: int | None) -> KVTier | None:
        """The disk tier, keyed by everything that changes what a block holds for the
        same tokens; None without kv_offload_dir."""
        cache_config, model_config = self.config.cache, self.model_config
        if cache_config.kv_offload_dir is None:
            return None
        if window is not None:
            raise ValueError(
                "kv_offload_dir: not supported yet where every layer of the model slides "
                f"({model_config.architecture})."
            )
        runner = self.model_runner
        key = fingerprint(
            weights_identity(model_config.path),
            json.dumps(model_config.hf_config, sort_keys=True, default=str),
            model_config.dtype,
            model_config.quantization,
            model_config.keep_full_precision,
            model_config.int8_activations,
            model_config.batch_invariant,
            model_config.kernel_backend,
            torch.backends.cpu.get_cpu_capability(),  # which kernels computed the K/V
            cache_config.block_size,
            runner.kv_cache_dtype_name,
            runner.kv_cache.shape,
        )
        tier = KVTier(
            cache_config.kv_offload_dir,
            cache_config.kv_offload_bytes,
            key,
            runner.kv_cache.read_blocks,
            cache_config.kv_offload_ram_bytes,
        )
        logger.info(
            "KV tier: %s (%.1f GiB at most), %d blocks there",
            tier.folder,
            cache_config.kv_offload_bytes / 2**30,
            len(tier),
        )
        return tier

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
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> None:
        """Check and queue a request. Raises InvalidRequestError (a ValueError naming the
        field) on bad input, and then has queued nothing.

        With `params.n > 1` the request runs as n children that share the
        prompt's blocks; its RequestOutput carries n completions. With
        `lora_request` it runs under that adapter (the engine needs enable_lora).
        `trace_headers` (W3C `traceparent`/`tracestate`) parent its exported span.
        `slo_ttft_ms`, `slo_tpot_ms`: its latency targets (default: the engine's); one
        that cannot be met now raises DeadlineUnmeetableError (a ValueError), and nothing
        is queued.
        """
        children, text = self.processor.process(
            request_id, prompt, params, priority, arrival_time, lora_request, trace_headers,
            SLO(slo_ttft_ms, slo_tpot_ms),
        )  # fmt: skip
        self.add_processed_request(request_id, children, text)

    def add_processed_request(
        self, request_id: str, children: list[Request], prompt_text: str | None
    ) -> None:
        """Queue a request that `processor.process` has already checked (the async engine
        runs the Processor on its own thread, then hands the result here). Raises
        DeadlineUnmeetableError, having queued nothing, if it cannot meet its targets."""
        # The children's ids ("<id>#<i>") must be free too: "x" with n=2 would take "x#1".
        # An aborted request's id stays taken while a step of it is in flight (pipeline
        # parallel): that step's output must not reach a new request of the same id.
        scheduler = self.scheduler
        for rid in (request_id, *(c.request_id for c in children)):
            if (
                rid in self.output_processor
                or rid in scheduler.requests
                or rid in scheduler.in_flight
            ):
                raise InvalidRequestError(f"request_id {rid!r} is already in use.", "request_id")
        lora = children[0].lora_request
        if lora is not None:
            self.model_runner.lora_manager.check_identity(lora)
        self.scheduler.add_request(children[0], fork_siblings=children[1:])  # may refuse it
        self.output_processor.add_request(request_id, children, prompt_text)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort requests by id, freeing their blocks; unknown ids are ignored. Returns
        their final outputs (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        child_ids = [cid for rid in ids for cid in self.output_processor.child_ids(rid)]
        aborted = self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        if self._loras_to_remove:
            self._remove_unused_loras()
        outputs, stats = self.output_processor.abort_requests(
            ids, time.monotonic(), {r.request_id: r.num_preemptions for r in aborted}
        )
        self._record(stats)
        return outputs

    def step(self) -> list[RequestOutput]:
        """Run one model step; returns the outputs of requests that progressed.

        A request whose step inputs or sampling raise fails alone (finish_reason
        "error", its blocks freed) and the others go on. Raises EngineDeadError if
        the failure cannot be pinned on requests (every request of the step fails).
        """
        scheduler_output, self._step_started = None, time.monotonic()
        if self._pipeline_depth == 1:
            scheduler_output = self.scheduler.schedule()
        elif len(self._steps_in_flight) < self._pipeline_depth:
            # Each step in flight takes its share of the requests, so that every
            # stage has one to work on.
            share = -(-len(self.scheduler.requests) // self._pipeline_depth)
            scheduler_output = self.scheduler.schedule(max_requests=max(1, share))
        outputs = self._fail_grammars(self.scheduler.grammars.take_failures())
        if scheduler_output is not None:  # a step that only swaps out must swap too
            self.model_runner.move_blocks(scheduler_output)
        if scheduler_output is not None and not scheduler_output.is_empty:
            if self._pipeline_depth == 1:
                runner_output, failures = self.failures.execute(
                    scheduler_output, self.model_runner.execute_model
                )
                return outputs + self._update(scheduler_output, runner_output, failures)
            self.model_runner.submit(scheduler_output)
            self._steps_in_flight.append(StepInFlight(scheduler_output))
            if len(self._steps_in_flight) < self._pipeline_depth:
                return outputs  # the first stage starts on the next step meanwhile
        if not self._steps_in_flight:
            self.scheduler.grammars.wait(timeout=0.05)  # a grammar compiling: rather than spin
            return outputs
        return outputs + self._update(*self._collect_oldest())

    def _collect_oldest(self) -> tuple[SchedulerOutput, ModelRunnerOutput, dict]:
        """Pipeline parallel: the oldest step in flight, its output and failures. If it
        failed, the later steps' outcomes are taken first (they are held), so that
        the retries that find the failing requests run alone."""
        step = self._steps_in_flight.popleft()
        outcome = step.outcome if step.outcome is not None else self._receive()

        def first(_: SchedulerOutput) -> ModelRunnerOutput:
            if isinstance(outcome, BaseException):
                for later in self._steps_in_flight:
                    if later.outcome is None:
                        later.outcome = self._receive()
                raise outcome
            return outcome

        return step.sched, *self.failures.execute(
            step.sched, self.model_runner.execute_model, first
        )

    def _receive(self) -> ModelRunnerOutput | Exception:
        try:
            return self.model_runner.collect()
        except EngineDeadError:
            raise
        except Exception as e:  # the step's error, to be pinned on its requests
            return e

    def _update(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        failures: dict[str, BaseException],
    ) -> list[RequestOutput]:
        """A step's results into the scheduler and the requests' outputs."""
        outputs = []
        now = time.monotonic()
        if failures:
            scheduler_output, failed_outputs, stats = self.failures.end_failed(
                scheduler_output, failures, now
            )
            self._record(stats)
            outputs += failed_outputs
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        progressed, stopped, failed, stats = self.output_processor.process_outputs(
            core_outputs, now, runner_output.pooled
        )
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        if self.kv_producer:  # (requests that finished this step, in the scheduler or here)
            self.kv_tier.flush()  # their answers wait for their blocks' files
        if self._loras_to_remove:
            self._remove_unused_loras()
        self._record(stats)
        if not failures:  # (pipeline parallel: the wait for the oldest step, about one stage's)
            took = time.monotonic() - self._step_started
            self.scheduler.deadlines.record_step(scheduler_output, took)
        return outputs + progressed

    def _fail_grammars(self, failures: dict[str, str]) -> list[RequestOutput]:
        """End the requests whose grammar failed to compile (all their completions)."""
        if not failures:
            return []
        op = self.output_processor
        by_parent = {op.parent_id(cid): why for cid, why in failures.items()}
        children = [cid for parent in by_parent for cid in op.child_ids(parent)]
        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
        outputs, stats = op.fail_requests(
            {
                parent: (f"structured_outputs: the grammar failed to compile: {why}", True)
                for parent, why in by_parent.items()
            },
            time.monotonic(),
        )
        self._record(stats)
        return outputs

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Check and read an adapter into the host cache (vLLM's name), so that its first
        request does not wait for the disk. Raises InvalidRequestError naming the file
        and field."""
        adapter = self.processor.load_lora(lora_request)
        self.model_runner.lora_manager.add(lora_request, adapter)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Free an adapter's slot and host copy (vLLM's name), once no unfinished
        request uses it (until then it stays, so they finish as they began). Returns
        whether it was held."""
        manager = self.model_runner.lora_manager
        if manager is None:
            return False
        if any(r.lora_int_id == lora_int_id for r in self.scheduler.requests.values()):
            self._loras_to_remove.add(lora_int_id)
            return True
        return manager.remove(lora_int_id)

    def _remove_unused_loras(self) -> None:
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        for lora_int_id in self._loras_to_remove - in_use:
            self.model_runner.lora_manager.remove(lora_int_id)
        self._loras_to_remove &= in_use

    def list_loras(self) -> list[int]:
        """The ids of the adapters resident in slots, least recently used first."""
        manager = self.model_runner.lora_manager
        return manager.resident_ids() if manager is not None else []

    def _record(self, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)

    def has_unfinished_requests(self) -> bool:
        """Requests a user sees, or steps still in flight (pipeline parallel: their
        requests may all have been aborted; collecting them frees their ids)."""
        return bool(self.output_processor.states or self._steps_in_flight)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def get_stats(self) -> SchedulerStats:
        """Running/waiting counts, preemptions, token counters and the KV cache's state
        (and with LoRA, the adapters in use and resident)."""
        stats = self.scheduler.get_stats()
        manager = self.model_runner.lora_manager
        if stats.lora is not None and manager is not None:
            lora = replace(stats.lora, num_resident=len(manager.resident_ids()))
            stats = replace(stats, lora=lora)
        return stats

    def snapshot(self, max_requests: int = 256) -> EngineSnapshot:
        """The stats, the KV block map and (at most `max_requests` of) the requests'
        progress, for the dashboard (about 1 ms with 11,650 blocks and 64 requests)."""
        scheduler = self.scheduler
        return EngineSnapshot(
            self.get_stats(),
            scheduler.kv_cache_manager.block_pool.block_map(),
            scheduler.progress(max_requests),
            len(scheduler.requests),
        )

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Write what the disk tier has queued; stop the worker processes, if the model
        is split across them (idempotent)."""
        if self.kv_tier is not None:
            self.kv_tier.close()
        shutdown = getattr(self.model_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
