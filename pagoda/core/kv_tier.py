"""A KV cache tier on disk that outlives the process: full prefix blocks that leave the
pool are written here, and a prefix lookup that misses in memory reads them back.

One file a block, `<dir>/<fingerprint>/<block hash>.kv`: a header (magic, the
fingerprint, the block's hash, the payload's length and its CRC-32), then
the block's K/V as the runner laid it out. The fingerprint keys everything that
changes what a block holds for the same tokens (the model's files, dtype, block size,
quantization, KV dtype, the cache's shape), so another model's blocks are never
found. A background thread copies each block out of the KV cache (the scheduler holds
it meanwhile) and writes it, off the step; the write goes to a temporary name and is
renamed into place (a reader never sees half a file, and two servers may share a
directory). The index (hash -> size, least recently used first) is rebuilt from the
directory at start, so a restart finds what was written before; a file another server
wrote is found on a miss. A damaged, truncated or foreign file is a miss, and is
removed: never a wrong token. Over the byte budget, the least recently used go.

Bytes only, no torch: the scheduler's KV cache manager asks what is here (`stage`) and
hands over blocks to keep (`save`); the runner's `read_blocks` copies them out. While
a router listens, the tier records which blocks became findable or stopped being, in
its RAM part and in its files (`start_events`; see pagoda.core.kv_events).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagoda.core.kv_events import DISK, RAM, TIER_MEDIA

logger = logging.getLogger(__name__)

MAGIC = b"PAGODAKV"
VERSION = 1
HEADER_BYTES = (
    len(MAGIC) + 1 + 16 + 16 + 8 + 4
)  # magic, version, fingerprint, hash, length, checksum


def fingerprint(*parts: object) -> bytes:
    """16 bytes naming what a block's K/V depends on besides its tokens."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def _checksum(payload: bytes | memoryview) -> bytes:
    """CRC-32: damage, not an adversary (the header names the model); 4x BLAKE2b's speed."""
    return zlib.crc32(payload).to_bytes(4, "little")


@dataclass
class TierStats:
    stored_blocks: int = 0  # (set by `snapshot`)
    stored_bytes: int = 0
    queries: int = 0  # blocks looked up here (after missing in memory)
    hits: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0  # reading and checking files
    blocks_removed: int = 0  # damaged or foreign files, and the budget's evictions
    ram_hits: int = 0  # of `hits`, found in the host-RAM tier (no file read)


class KVTier:
    def __init__(
        self,
        directory: str,
        max_bytes: int,
        fingerprint: bytes,
        read_blocks: Callable[[list[int]], list[bytes]],
        ram_bytes: int = 0,
    ) -> None:
        """`read_blocks`: the blocks' K/V as bytes (called on the writer thread).
        `ram_bytes`: a tier in host RAM before the disk, of at most that many bytes of
        blocks (the most recently copied or found): a hit there reads no file. On a GPU
        it is what a block leaving device memory lands in first; the CPU runs it alike."""
        self.fingerprint = fingerprint
        self.read_blocks = read_blocks
        self.folder = os.path.join(directory, fingerprint.hex())
        os.makedirs(self.folder, exist_ok=True)
        # Servers on one folder share its blocks: a router counts them for each.
        real = os.path.realpath(self.folder).encode()
        self.tier_id = hashlib.blake2b(real, digest_size=8).hexdigest()
        self.max_bytes = max_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()  # the index: the engine thread and the writer's
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self._num_bytes = 0
        self._pending: set[bytes] = set()  # queued for writing
        self._unwritten: dict[bytes, bytes] = {}  # copied out, file not yet written
        self._copied: list[int] = []  # blocks the writer is done reading
        self.num_copying = 0  # blocks queued and not yet read
        self._copy_done = threading.Condition(self._lock)
        self._staged: dict[bytes, memoryview] = {}  # read and checked, for the runner
        self.ram_bytes = ram_bytes
        self._ram: OrderedDict[bytes, bytes] = OrderedDict()  # hash -> payload, LRU first
        self._ram_used = 0
        self._queue: queue.Queue[tuple[bytes, int] | None] = queue.Queue()
        # While someone listens: medium -> block hash -> findable there now (see kv_events).
        self._events: dict[str, dict[bytes, bool]] | None = None
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        atexit.register(self.close)  # what is queued is written before the process ends

    # ---- what is here --------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def snapshot(self) -> TierStats:
        with self._lock:
            return replace(self.stats, stored_blocks=len(self._index), stored_bytes=self._num_bytes)

    def holds(self, block_hash: bytes) -> bool:
        """Whether the block is here or on its way (no need to write it again)."""
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def stage(self, hashes: list[bytes]) -> int:
        """Read and check the blocks of `hashes` from the first on, while they are here;
        returns how many were, their payloads kept for `take`. Runs on the engine
        thread as a request is admitted: these reads replace computing the blocks."""
        start, n = time.perf_counter(), 0
        for block_hash in hashes:
            if block_hash not in self._staged:  # (else staged by a try that did not fit)
                self.stats.queries += 1
                with self._lock:  # (its memory block may be gone while its file is not there)
                    payload = self._unwritten.get(block_hash) or self._ram.get(block_hash)
                    if payload is not None and block_hash in self._ram:
                        self._ram.move_to_end(block_hash)
                        self.stats.ram_hits += 1
                if payload is None:
                    payload = self._read(block_hash)
                    if payload is not None and self.ram_bytes:  # (a copy: the file's view)
                        self._keep_in_ram([(block_hash, bytes(payload))])
                if payload is None:
                    break
                self._staged[block_hash] = payload
                self.stats.hits += 1
            n += 1
        self.stats.load_seconds += time.perf_counter() - start
        return n

    def take(self, block_hash: bytes) -> memoryview:
        """A staged block's payload (the runner loads it into the block allocated for it)."""
        return self._staged.pop(block_hash)

    def drop_staged(self) -> None:
        """Forget what was staged and not taken (its request could not be admitted)."""
        self._staged.clear()

    # ---- events ---------------------------------------------------------------------

    def start_events(self) -> dict[str, dict[bytes, bool]]:
        """Record changes from now on; returns what is findable now, per medium (the
        files as the directory lists them, another server's included)."""
        with self._lock:
            if self._events is None:
                self._events = {medium: {} for medium in TIER_MEDIA}
            in_ram = dict.fromkeys(self._ram, True)
            on_disk = dict.fromkeys(self._unwritten, True)
        # (listed after recording starts: a file that comes or goes meanwhile is in a batch)
        with os.scandir(self.folder) as it:
            for entry in it:
                with contextlib.suppress(ValueError):
                    if entry.name.endswith(".kv"):
                        on_disk[bytes.fromhex(entry.name[:-3])] = True
        return {RAM: in_ram, DISK: on_disk}

    def take_events(self) -> dict[str, dict[bytes, bool]]:
        """The changes since the last call, per medium ({} when not recording)."""
        with self._lock:
            events = self._events
            if events is not None:
                self._events = {medium: {} for medium in TIER_MEDIA}
        return events or {}

    def stop_events(self) -> None:
        with self._lock:
            self._events = None

    def _note(self, medium: str, block_hash: bytes, findable: bool) -> None:
        """Record a change, while someone listens (under the lock)."""
        if self._events is not None:
            self._events[medium][block_hash] = findable

    # ---- writing ------------------------------------------------------------------

    def save(self, block_hash: bytes, block_id: int) -> bool:
        """Queue a block for the writer; False if the tier holds it (or will). The
        caller keeps the block unchanged until `take_saved` returns it."""
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return False
            self._pending.add(block_hash)
            self.num_copying += 1
        self._queue.put((block_hash, block_id))
        return True

    def wait_copied(self) -> None:
        """Wait until the writer has read every queued block."""
        with self._copy_done:
            self._copy_done.wait_for(lambda: self.num_copying == 0)

    def take_saved(self) -> list[int]:
        """The blocks copied out since the last call (their holder may let them go)."""
        with self._lock:
            copied, self._copied = self._copied, []
        return copied

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (idempotent)."""
        atexit.unregister(self.close)
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def _write_loop(self) -> None:
        # The lowest priority: the step's threads hold every core, and the writer works
        # in their gaps (the engine waits for it only where it needs the room it holds).
        with contextlib.suppress(OSError, AttributeError):  # (not Linux: as it comes)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while not self._queue.empty() and len(batch) < 64:  # one copy for a request's blocks
                batch.append(self._queue.get())
            stop = None in batch
            items = [item for item in batch if item is not None]
            try:
                payloads = self.read_blocks([block_id for _, block_id in items]) if items else []
            except Exception:  # the cache is gone (shutting down after a failure)
                logger.exception("KV tier: copying blocks failed")
                payloads = [None] * len(items)
            copied = [(h, p) for (h, _), p in zip(items, payloads, strict=True) if p is not None]
            self._keep_in_ram(copied)
            with self._lock:
                self._copied += [block_id for _, block_id in items]
                self._unwritten.update(copied)
                for block_hash, _ in copied:  # findable from here on (the copy, then the file)
                    self._note(DISK, block_hash, True)
                self.num_copying -= len(items)
                self._copy_done.notify_all()
            for (block_hash, _), payload in zip(items, payloads, strict=True):
                try:
                    if payload is not None:
                        self._write(block_hash, payload)
                except Exception:  # a full disk, a permission: the block is just not kept
                    logger.exception("KV tier: writing a block failed")
                finally:
                    with self._lock:
                        self._pending.discard(block_hash)
                        was_copied = self._unwritten.pop(block_hash, None) is not None
                        if was_copied and block_hash not in self._index:
                            self._note(DISK, block_hash, False)  # not written, or evicted at once
            for _ in batch:
                self._queue.task_done()

    def _keep_in_ram(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Put payloads in the host-RAM tier, the least recently used out past its bytes."""
        if not self.ram_bytes:
            return
        with self._lock:
            for block_hash, payload in blocks:
                if block_hash not in self._ram and len(payload) <= self.ram_bytes:
                    self._ram[block_hash] = payload
                    self._ram_used += len(payload)
                    self._note(RAM, block_hash, True)
            while self._ram_used > self.ram_bytes:
                old_hash, old = self._ram.popitem(last=False)
                self._ram_used -= len(old)
                self._note(RAM, old_hash, False)

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        header = (
            MAGIC + bytes([VERSION]) + self.fingerprint + block_hash
            + len(payload).to_bytes(8, "little") + _checksum(payload)
        )  # fmt: skip
        path = self._path(block_hash)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)  # atomic: a reader sees the old file, or the whole new one
        size = len(header) + len(payload)
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self._num_bytes += size
            self.stats.bytes_written += size
            evicted = self._over_budget()
        for old in evicted:
            self._remove_file(old)

    def _over_budget(self) -> list[bytes]:
        """Take the least recently used out of the index until it fits (under the lock)."""
        evicted = []
        while self._num_bytes > self.max_bytes and self._index:
            old, size = self._index.popitem(last=False)
            self._num_bytes -= size
            evicted.append(old)
            self._note(DISK, old, False)
        return evicted

    # ---- reading ------------------------------------------------------------------

    def _read(self, block_hash: bytes) -> memoryview | None:
        """The block's payload, checked; None (and the file removed if it is bad) if it
        is not here."""
        path = self._path(block_hash)
        with self._lock:
            known = block_hash in self._index
        if not known and not os.path.exists(path):  # (another server's, written since)
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self._forget(block_hash)
            return None
        payload = self._payload(data, block_hash)
        if payload is None:
            logger.warning("KV tier: %s is damaged or foreign; removed", os.path.basename(path))
            self._forget(block_hash)
            self._remove_file(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            else:
                self._index[block_hash] = len(data)
                self._num_bytes += len(data)
                self._note(DISK, block_hash, True)  # (another server's file)
            self.stats.bytes_read += len(data)
        return payload

    def _payload(self, data: bytes, block_hash: bytes) -> memoryview | None:
        """The payload of a file's bytes, if its header and checksum hold."""
        if len(data) < HEADER_BYTES or data[: len(MAGIC)] != MAGIC or data[len(MAGIC)] != VERSION:
            return None
        at = len(MAGIC) + 1
        if data[at : at + 16] != self.fingerprint or data[at + 16 : at + 32] != block_hash:
            return None
        length = int.from_bytes(data[at + 32 : at + 40], "little")
        checksum = data[at + 40 : at + 44]
        payload = memoryview(data)[HEADER_BYTES:]  # (not copied)
        if len(payload) != length or _checksum(payload) != checksum:
            return None
        return payload

    # ---- the index ----------------------------------------------------------------

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.folder, block_hash.hex() + ".kv")

    def _rebuild_index(self) -> None:
        """What the directory holds, oldest first (by modification time)."""
        entries = []
        with os.scandir(self.folder) as it:
            for entry in it:
                if not entry.name.endswith(".kv"):
                    continue
                try:
                    block_hash = bytes.fromhex(entry.name[:-3])
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                entries.append((stat.st_mtime, block_hash, stat.st_size))
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self._num_bytes += size
        evicted = self._over_budget()
        for old in evicted:
            self._remove_file(old)
        if self._index:
            logger.info(
                "KV tier: %d blocks (%.1f MiB) found in %s",
                len(self._index),
                self._num_bytes / 2**20,
                self.folder,
            )

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._num_bytes -= size
            self._note(DISK, block_hash, False)

    def _remove_file(self, block_hash: bytes) -> None:
        self.stats.blocks_removed += 1
        with contextlib.suppress(OSError):  # gone already (another server's eviction)
            os.remove(self._path(block_hash))
