"""`RayExecutor`: the workers as Ray actors (`--distributed-executor-backend ray`), so
that a model's shards can sit on several hosts of a Ray cluster.

The engine connects to the cluster that `RAY_ADDRESS` names (`ray start --head` on
one host, `ray start --address HEAD:6379` on the others), or starts a local one. It
reserves one placement-group bundle of CPUs per worker (PACK: on as few hosts as
fit), finds rank 0's host address and a free port there for torch.distributed's
rendezvous (gloo over TCP), and creates one `Worker` actor per bundle. Ray runs an
actor's calls in the order they were made, so a step's `execute_model` calls, like
its `move_blocks` before it, reach every worker in order; the engine keeps several
steps in flight (pipeline parallel) as with worker processes. When every worker is on
one host, the TP all-reduces of small tensors go through shared memory there too.

A worker that dies (its actor fails) makes the engine raise `EngineDeadError`; actors
are owned by the engine's process, so Ray ends them when it ends.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import deque
from typing import Any

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.errors import EngineDeadError
from pagoda.ray_cluster import connect_ray
from pagoda.worker.executor import Executor, Worker

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120  # a cluster without the CPUs asked for: say so, do not hang


def _free_address() -> tuple[str, int]:
    """This host's address in the cluster, and a port free on it."""
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class RayExecutor(Executor):
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        draft_model_config: ModelConfig | None,
        parallel: ParallelConfig,
        num_threads: int | None = None,
    ) -> None:
        ray = connect_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        world = parallel.world_size
        cpus = num_threads or max(1, int(ray.cluster_resources().get("CPU", 1)) // world)
        self.placement = placement_group([{"CPU": cpus}] * world, strategy="PACK")
        self.actors: list[Any] = []
        try:
            ray.get(self.placement.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            self.shutdown()
            raise ValueError(
                f"distributed_executor_backend 'ray': the cluster has no room for {world} "
                f"workers of {cpus} CPUs each ({ray.cluster_resources()})."
            ) from e

        def on(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.placement, bundle)

        host, port = ray.get(
            ray.remote(num_cpus=0)(_free_address).options(scheduling_strategy=on(0)).remote()
        )
        nodes = ray.util.placement_group_table(self.placement)["bundles_to_node_id"]
        one_host = len(set(nodes.values())) == 1
        shm_dir = None
        if one_host and os.path.isdir("/dev/shm"):
            shm_dir = f"/dev/shm/pagoda-ray-{uuid.uuid4().hex}"
        actor = ray.remote(Worker)
        # The actors' processes do not inherit this one's environment.
        env = {k: v for k, v in os.environ.items() if k.startswith("PAGODA_")}
        self.actors = [
            actor.options(
                num_cpus=cpus, scheduling_strategy=on(rank), runtime_env={"env_vars": env}
            ).remote(
                rank,
                parallel,
                f"tcp://{host}:{port}",
                shm_dir,
                cpus,
                model_config,
                cache_config,
                draft_model_config,
            )
            for rank in range(world)
        ]
        logger.info(
            "%d Ray workers of %d CPUs each (%s), rendezvous at %s:%d",
            world,
            cpus,
            "one host" if one_host else f"{len(set(nodes.values()))} hosts",
            host,
            port,
        )
        self.driver = world - parallel.tensor_parallel_size  # rank 0 of the last stage
        self._in_flight: deque[list] = deque()  # each submitted step's calls
        self._moves: list = []  # move_blocks calls not yet checked
        try:
            self._set_info(self._get([a.info.remote() for a in self.actors])[self.driver])
        except BaseException:
            self.shutdown()
            raise

    def submit(self, sched: SchedulerOutput) -> None:
        self._in_flight.append([a.execute_model.remote(sched) for a in self.actors])

    def collect(self) -> ModelRunnerOutput:
        calls = self._in_flight.popleft()
        moves, self._moves = self._moves, []
        try:
            self._get(moves)
        except EngineDeadError:
            raise
        except Exception as e:  # the KV cache is not what the scheduler thinks
            self.shutdown()
            raise EngineDeadError(f"a Ray worker failed to move blocks: {e!r}") from e
        return self._get(calls)[self.driver]

    def move_blocks(self, sched: SchedulerOutput) -> None:
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_copy:
            self._moves += [a.move_blocks.remote(sched) for a in self.actors]

    def _get(self, refs: list) -> list:
        """Every call's result; a worker's error raised as itself (after all have
        answered, so the next step finds them in step). A dead actor, or a worker whose
        step failed between collectives (`EngineDeadError`), stops the engine at once:
        taken in the order they finish, not waiting on a peer that waits for the dead
        one in a collective."""
        ray = self._ray
        results: dict[Any, Any] = {}
        error = None
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self.shutdown()
                raise EngineDeadError(
                    f"a Ray worker died ({e}); the model is split across workers, so the "
                    "engine cannot go on."
                ) from e
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if e.cause is not None else e
                if isinstance(cause, EngineDeadError):  # out of step: peers may wait
                    self.shutdown()
                    raise cause from None
                results[ready[0]] = None
                error = error or cause
        if error is not None:
            raise error
        return [results[ref] for ref in refs]

    def shutdown(self) -> None:
        ray = self._ray
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement is not None:
            ray.util.remove_placement_group(self.placement)
            self.placement = None

    def __del__(self) -> None:
        if getattr(self, "actors", None):
            self.shutdown()
