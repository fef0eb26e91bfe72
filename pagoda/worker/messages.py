"""The typed messages between the engine and its worker processes (pickled over
each worker's pipe): the setup a worker starts from, the calls the engine makes each
step, and the reply to a call that has one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.config import CacheConfig, ModelConfig, ParallelConfig
from pagoda.core.sched_output import SchedulerOutput


@dataclass(frozen=True)
class WorkerSetup:
    rank: int
    parallel: ParallelConfig
    cores: list[int]  # the cores it pins itself to
    num_threads: int | None
    store: str  # the folder of torch.distributed's file store
    shm_dir: str | None  # this host's tensor-parallel all-reduce files
    engine_pid: int  # a worker whose parent is no longer this exits at once
    model_config: ModelConfig
    cache_config: CacheConfig
    draft_model_config: ModelConfig | None


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker's runner tells the engine once built (the same on every rank)."""

    num_blocks: int
    num_host_blocks: int
    kv_cache_dtype_name: str
    vocab_size: int
    bytes_per_block: int  # all shards of one block
    kv_expanded_bytes_per_token: int | None
    sliding_window: int | None


@dataclass(frozen=True)
class ExecuteModel:
    """Run the step; every worker replies (the driver with the step's output)."""

    sched: SchedulerOutput


@dataclass(frozen=True)
class MoveBlocks:
    """The step's swaps and copies, before its forward; no reply (a worker that fails
    them exits, and the engine with it)."""

    sched: SchedulerOutput


WorkerCall = ExecuteModel | MoveBlocks


@dataclass(frozen=True)
class WorkerReply:
    """A call's result, or the error it raised."""

    value: Any = None
    error: BaseException | None = None
