"""Executors: the engine's model runner when the model is split across worker
processes (tensor and pipeline parallel). `MultiprocExecutor` spawns them on this
machine (`--distributed-executor-backend mp`); `RayExecutor` (ray_executor.py)
places them as Ray actors, on any host of a Ray cluster (`ray`). Both drive the same
`Worker`s.

The engine keeps one scheduler and one block manager; one block table serves every
shard, as in vLLM. Each step the executor sends the `SchedulerOutput` to every worker
(spawned processes, each pinned to its own cores, one `ModelRunner` each over its
shard of the model and of every KV block, talking among themselves over
torch.distributed with gloo), and waits for all of them: the driver (rank 0 of the
last stage) answers with the sampled tokens, the others with None, and any worker's
error is raised here, so the engine's isolation of failing requests works as with one
process. A worker that dies (its process sentinel fires) makes the engine raise
`EngineDeadError`; workers exit when the engine's end of their pipe closes, and the
kernel kills them if the engine process dies (PR_SET_PDEATHSIG), so none is orphaned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid
from multiprocessing import connection
from typing import Any

from pagoda import envs
from pagoda.config import CacheConfig, ModelConfig, ParallelConfig
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.errors import EngineDeadError
from pagoda.worker.messages import (
    ExecuteModel,
    MoveBlocks,
    WorkerCall,
    WorkerInfo,
    WorkerReply,
    WorkerSetup,
)

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer before it fails (a wedged worker).


class Worker:
    """One rank: its place in the groups and its `ModelRunner` over its shard."""

    def __init__(
        self,
        rank: int,
        parallel: ParallelConfig,
        init_method: str,
        shm_dir: str | None,
        num_threads: int,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        draft_model_config: ModelConfig | None,
    ) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from pagoda.distributed import ParallelContext
        from pagoda.worker.model_runner import ModelRunner

        torch.set_num_threads(num_threads)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=parallel.world_size,
            timeout=timedelta(seconds=envs.distributed_timeout_s()),
        )
        self.rank = rank
        if shm_dir is not None:  # on this host: the TP groups' all-reduce files
            os.makedirs(shm_dir, exist_ok=True)
        self.context = ParallelContext.init(
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size, rank, shm_dir
        )
        dist.barrier()  # every group is built and its file unlinked
        if shm_dir is not None and rank == 0:
            os.rmdir(shm_dir)
        self.runner = ModelRunner(
            model_config, cache_config, None, draft_model_config, parallel=self.context
        )

    def info(self) -> WorkerInfo:
        """What the engine reads off its runner (the same on every rank)."""
        runner = self.runner
        return WorkerInfo(
            num_blocks=runner.num_blocks,
            num_host_blocks=runner.num_host_blocks,
            kv_cache_dtype_name=runner.kv_cache_dtype_name,
            vocab_size=runner.vocab_size,
            bytes_per_block=self.context.sum_over_workers(runner.bytes_per_block),
            kv_expanded_bytes_per_token=self.context.sum_over_workers(
                runner.kv_expanded_bytes_per_token
            ),
            sliding_window=runner.sliding_window,
        )

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on the driver; None on the other ranks.

        An error in the forward or the logits gathers may come on one rank while its
        peers wait in a collective (or have moved past one it never reached): the ranks
        are out of step for good, so it is raised as `EngineDeadError` and the executor
        stops every worker at once. An error in sampling, after the last collective,
        is the step's requests' own (the engine isolates them)."""
        try:
            step = self.runner.forward_step(sched)
        except Exception as e:
            text = "".join(traceback.format_exception(e))
            raise EngineDeadError(
                f"worker {self.rank}: a step failed between collectives, so the workers "
                f"are out of step: {text}"
            ) from e
        return self.runner.sample_step(step) if self.context.is_driver else None

    def move_blocks(self, sched: SchedulerOutput) -> None:
        self.runner.move_blocks(sched)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class Executor:
    """The `ModelRunner` surface the engine uses, over `parallel.world_size` workers:
    `submit` a step, `collect` the oldest one's output (the driver's), `move_blocks`
    before a step; the KV cache's size as the workers found it."""

    lora_manager = None  # LoRA is not split across workers (EngineArgs refuses it)
    decode_loop_max_rows = 0  # the C++ decode loop runs no collectives

    def _set_info(self, info: WorkerInfo) -> None:
        self.num_blocks = info.num_blocks
        self.num_host_blocks = info.num_host_blocks
        self.kv_cache_dtype_name = info.kv_cache_dtype_name
        self.vocab_size = info.vocab_size
        self.bytes_per_block = info.bytes_per_block  # all shards of one block
        self.kv_expanded_bytes_per_token = info.kv_expanded_bytes_per_token
        self.sliding_window = info.sliding_window

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect()

    def submit(self, sched: SchedulerOutput) -> None:
        raise NotImplementedError

    def collect(self) -> ModelRunnerOutput:
        raise NotImplementedError


class MultiprocExecutor(Executor):
    """Workers as processes of this machine, each pinned to its share of the cores."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        draft_model_config: ModelConfig | None,
        parallel: ParallelConfig,
    ) -> None:
        self.parallel = parallel
        world = parallel.world_size
        cores = sorted(os.sched_getaffinity(0))
        # Every rank runs as many threads as the smallest share has cores: work that
        # each rank repeats (a replicated draft model, MoE experts) must give every
        # rank the same bits, and a kernel's sums can depend on its thread count.
        num_threads = max(1, len(cores) // world)
        self._store_dir = tempfile.TemporaryDirectory(prefix="pagoda-dist-")
        store = os.path.join(self._store_dir.name, "store")  # the group's rendezvous
        self._shm_dir = f"/dev/shm/pagoda-{uuid.uuid4().hex}" if os.path.isdir("/dev/shm") else None
        self.workers: list[subprocess.Popen] = []
        self.sentinels: list[int] = []  # pidfds: readable once the worker has exited
        self.conns: list[connection.Connection] = []
        self.driver = world - parallel.tensor_parallel_size  # rank 0 of the last stage
        try:
            for rank in range(world):
                # Each rank its own share of the cores; more ranks than cores share them.
                share = cores[rank * len(cores) // world : (rank + 1) * len(cores) // world]
                share = share or [cores[rank % len(cores)]]
                ours, theirs = socket.socketpair()
                # A fresh interpreter running this module (not multiprocessing's spawn,
                # which imports the caller's __main__ again: scripts without a main guard).
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pagoda.worker.executor", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                )
                theirs.close()
                self.workers.append(proc)
                self.sentinels.append(os.pidfd_open(proc.pid))
                self.conns.append(connection.Connection(ours.detach()))
                setup = WorkerSetup(
                    rank, parallel, share, num_threads, store, self._shm_dir, os.getpid(),
                    model_config, cache_config, draft_model_config,
                )  # fmt: skip
                self.conns[-1].send_bytes(pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL))
                logger.info("worker %d: pid %d on cores %s", rank, proc.pid, share)
            # A rank that fails to start leaves its peers waiting in a collective: the
            # first error stops them all.
            self._set_info(self._gather(fail_fast=True)[self.driver])
        except BaseException:
            self.shutdown(grace_s=0)
            raise

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a step; `collect` returns its output. Steps submitted before are
        collected first: with pipeline parallel, stage 0 starts this one while later
        stages finish those."""
        self._send(ExecuteModel(sched))

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not yet collected."""
        return self._gather()[self.driver]

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """The step's swaps and copies, done by each worker before its next step (no
        answer: a worker that fails them exits, and the engine with it)."""
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_copy:
            self._send(MoveBlocks(sched))

    def _send(self, call: WorkerCall) -> None:
        message = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError as e:
                raise self._dead(rank) from e

    def _gather(self, fail_fast: bool = False) -> list[Any]:
        """Every worker's answer to the last message; the first error any raised is
        raised here (all of them answer first, so the next message finds them in step).
        An `EngineDeadError` from a worker (its step failed between collectives), or
        with `fail_fast` any error, stops every worker at once instead: the others may
        be waiting for it in a collective."""
        results: list[Any] = [None] * len(self.conns)
        errors: list[BaseException] = []
        waiting = dict(enumerate(self.conns))
        while waiting:
            sentinels = {self.sentinels[rank]: rank for rank in waiting}
            ready = connection.wait([*waiting.values(), *sentinels])
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if not waiting[rank].poll():  # died, with nothing left to read
                        raise self._dead(rank)
                    continue
                rank = next(r for r, c in waiting.items() if c is obj)
                try:
                    reply: WorkerReply = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError) as e:
                    raise self._dead(rank) from e
                del waiting[rank]
                if reply.error is None:
                    results[rank] = reply.value
                elif fail_fast or isinstance(reply.error, EngineDeadError):
                    self.shutdown(grace_s=0)
                    raise reply.error
                else:
                    errors.append(reply.error)
        if errors:
            raise errors[0]
        return results

    def _dead(self, rank: int) -> EngineDeadError:
        proc = self.workers[rank]
        try:
            code = proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        self.shutdown(grace_s=0)  # the others may wait on it in a collective
        return EngineDeadError(
            f"worker {rank} (pid {proc.pid}) died (exit code {code}); the model is split "
            "across workers, so the engine cannot go on."
        )

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Close the pipes (each worker exits when its pipe closes), then wait for the
        workers; one that does not exit in `grace_s` is killed."""
        for conn in self.conns:
            conn.close()
        self.conns = []
        for proc in self.workers:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self.sentinels:
            os.close(fd)
        self.workers, self.sentinels = [], []
        self._store_dir.cleanup()
        if self._shm_dir is not None:  # left behind when a start failed half way
            shutil.rmtree(self._shm_dir, ignore_errors=True)

    def __del__(self) -> None:
        if getattr(self, "workers", None):
            self.shutdown()


def _worker_main(fd: int) -> None:
    """A worker process: join the group, build its shard, answer messages until the
    engine's end of the pipe closes."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle
    conn = connection.Connection(fd)
    try:
        setup: WorkerSetup = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    rank = setup.rank
    if os.getppid() != setup.engine_pid:  # the engine died before prctl
        return
    os.sched_setaffinity(0, setup.cores)
    try:
        worker = Worker(
            rank,
            setup.parallel,
            f"file://{setup.store}",
            setup.shm_dir,
            setup.num_threads,
            setup.model_config,
            setup.cache_config,
            setup.draft_model_config,
        )
        _reply(conn, WorkerReply(worker.info()))
    except BaseException as e:
        _reply(conn, WorkerReply(error=e))
        return
    inbox = _read_messages(conn)
    while (message := inbox.get()) is not None:  # None: the engine is gone or done
        call: WorkerCall = pickle.loads(message)
        if isinstance(call, MoveBlocks):
            try:
                worker.move_blocks(call.sched)
            except BaseException:  # the KV cache is not what the scheduler thinks
                logger.exception("worker %d: moving blocks failed", rank)
                os._exit(1)
            continue
        try:
            _reply(conn, WorkerReply(worker.execute_model(call.sched)))
        except Exception as e:
            _reply(conn, WorkerReply(error=e))
    worker.close()


def _read_messages(conn: connection.Connection) -> queue.SimpleQueue:
    """The engine's messages, read as they come by a thread of their own (None once the
    pipe closes). With pipeline parallel the engine sends the next step while the
    driver may still be writing a large answer to the last: if each waited for the
    other to read, both would block for good."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                inbox.put(conn.recv_bytes())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=read, name="pagoda-worker-inbox", daemon=True).start()
    return inbox


def _reply(conn: connection.Connection, reply: WorkerReply) -> None:
    """Send the reply; an error that does not survive pickling goes as a RuntimeError
    carrying its traceback."""
    try:
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
    except Exception:
        if reply.error is None:
            raise
        text = "".join(traceback.format_exception(reply.error))
        data = pickle.dumps(WorkerReply(error=RuntimeError(f"in a worker: {text}")))
    with contextlib.suppress(OSError):  # the engine is gone
        conn.send_bytes(data)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
