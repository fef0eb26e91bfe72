"""A request fails alone: when a step raises, its requests run again in halves
(recursively) until each error is pinned on the requests that raise it on their own;
those end with finish_reason "error" and the rest go on. A step whose every request
fails (not by their own input), or lone failures MAX_FAILED_STEPS steps in a row, is
the engine's fault: EngineDeadError.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.core.stats import IterationStats
from pagoda.engine.output_processor import OutputProcessor
from pagoda.errors import EngineDeadError, InvalidRequestError
from pagoda.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Steps in a row in which a lone request failed (not by its own input) before the
# engine gives up: a fault that hits whatever runs is the engine's, not a request's.
MAX_FAILED_STEPS = 3


@dataclass
class StepInFlight:
    """Pipeline parallel: a step submitted to the stages, and what came back of it once
    taken early (held while an earlier step's failure is pinned down)."""

    sched: SchedulerOutput
    outcome: ModelRunnerOutput | Exception | None = None


class FailureIsolation:
    def __init__(
        self,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        steps_in_flight: deque[StepInFlight],
    ) -> None:
        """`steps_in_flight`: the engine's (its later steps drop requests to retry)."""
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.steps_in_flight = steps_in_flight
        self.num_failed_steps = 0  # consecutive steps where a request failed on its own

    def execute(
        self,
        sched: SchedulerOutput,
        execute_model: Callable[[SchedulerOutput], ModelRunnerOutput],
        first: Callable[[SchedulerOutput], ModelRunnerOutput] | None = None,
    ) -> tuple[ModelRunnerOutput, dict[str, BaseException]]:
        """Run the step with `execute_model` (the first time with `first`, if given: a
        pipeline step's outcome already on its way); if it raises, run halves of it
        again (recursively) to find the requests that fail on their own. Returns
        (merged output, child id -> error)."""
        try:
            output = (first or execute_model)(sched)
            self.num_failed_steps = 0
            return output, {}
        except EngineDeadError:  # a worker process died: no request is to blame
            raise
        except Exception as e:
            if len(sched.scheduled) > 1:
                logger.warning(
                    "a step of %d requests failed (%r); running them apart to find which",
                    len(sched.scheduled),
                    e,
                )
            first_error = e
        results: list[ModelRunnerOutput] = []
        failures: dict[str, BaseException] = {}

        def run(part: list, known_to_fail: bool) -> None:
            """Run `part` (again); if it fails, each half: a lone request that fails owns
            its error."""
            if not known_to_fail:
                try:
                    results.append(execute_model(replace(sched, scheduled=part)))
                    return
                except EngineDeadError:
                    raise
                except Exception as e:
                    if len(part) == 1:
                        failures[part[0].request_id] = e
                        return
            for half in (part[: len(part) // 2], part[len(part) // 2 :]):
                run(half, False)

        # A request aborted while this step was in flight (pipeline parallel) is not run
        # again: its blocks may be another request's by now.
        live = [s for s in sched.scheduled if s.request_id in self.scheduler.requests]
        if len(live) == len(sched.scheduled) == 1:
            failures[live[0].request_id] = first_error
        elif live:
            run(live, known_to_fail=len(live) == len(sched.scheduled))
        # Decide by user requests, not completions: one request with n = 4 whose sampling
        # fails is one request failing alone.
        failed = {self._parent_id(cid) for cid in failures}
        scheduled = {self._parent_id(s.request_id) for s in live}
        real_failures = [e for e in failures.values() if not isinstance(e, InvalidRequestError)]
        self.num_failed_steps = self.num_failed_steps + 1 if real_failures else 0
        # Requests that all failed by their own input (say, the same unreadable adapter)
        # say nothing against the engine.
        if (
            failed == scheduled
            and real_failures
            and (len(failed) > 1 or self.num_failed_steps >= MAX_FAILED_STEPS)
        ):
            raise EngineDeadError(
                f"every request of the step failed ({len(failed)}): {first_error!r}"
            ) from first_error
        for request_id, error in failures.items():
            logger.error("request %s failed in its step: %r", request_id, error, exc_info=error)
        return ModelRunnerOutput.merge(results), failures

    def _parent_id(self, request_id: str) -> str:
        """The user's request that a scheduler request (a completion, or a beam) serves."""
        return self.output_processor.parent_id(self.scheduler.beams.completion_id(request_id))

    def end_failed(
        self, sched: SchedulerOutput, failures: dict[str, BaseException], now: float
    ) -> tuple[SchedulerOutput, list[RequestOutput], IterationStats]:
        """End the requests that own the failed children (all their completions), free
        their blocks, and drop them from the step's results. The blocks they allocated
        for the step may hold nothing valid: another request of the step that shares one
        (a same-step prefix hit) goes back to compute its tokens again."""
        op = self.output_processor
        by_parent = {self._parent_id(cid): error for cid, error in failures.items()}
        ended = {cid for parent in by_parent for cid in op.child_ids(parent)}
        suspect = self.scheduler.fail_requests(ended)
        retry = {
            s.request_id
            for s in sched.scheduled
            if s.request_id not in ended and suspect.intersection(s.block_ids)
        }
        for step in self.steps_in_flight:  # later steps may have found them cached too
            later = {
                s.request_id for s in step.sched.scheduled if suspect.intersection(s.block_ids)
            }
            if later:
                kept = [s for s in step.sched.scheduled if s.request_id not in later]
                step.sched = replace(step.sched, scheduled=kept)
                retry |= later
        self.scheduler.recompute_requests(retry)
        outputs, stats = op.fail_requests(
            {
                parent: (f"the request failed: {error!r}", isinstance(error, InvalidRequestError))
                for parent, error in by_parent.items()
            },
            now,
        )
        remaining = [s for s in sched.scheduled if s.request_id not in ended | retry]
        return replace(sched, scheduled=remaining), outputs, stats
