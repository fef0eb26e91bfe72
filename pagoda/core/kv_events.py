"""KV cache events: what an engine can find by block hash, and where, as it changes,
for a router that sends each request where its prefix is cached (vLLM publishes the
same facts as `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events, each naming
its medium).

Three media, fastest first: the engine's KV cache pool (`POOL`), the KV tier's
host-RAM part (`RAM`), and the tier's files (`DISK`, pagoda.core.kv_tier). The pool
and the RAM part are the engine's own; a tier directory is shared by every server on
it, so its blocks are named with the tier's id (`tier_id`: the same for engines on one
folder with one fingerprint), and a router counts them for each of those servers.

While someone listens, the block pool and the tier record the net change of each
block hash since the last batch, per medium: True once it becomes findable there,
False once it stops being (evicted, removed, its content in doubt). A listener's first
batch is a snapshot (`cleared`, then every hash findable, the tier's files as its
directory lists them), so snapshot + batches is what the engine can find. Hashes are
the chained block hashes of `kv_cache_manager.hash_block`, which a router computes
from the prompt alone.

One batch per line of JSON on the wire (`GET /kv_events` of `pagoda serve`):
`{"cleared": bool, "stored": [hex, ...], "removed": [hex, ...]}` for the pool, and
with a tier `"tier": {"id": str, "ram": {"stored": [...], "removed": [...]},
"disk": {"stored": [...], "removed": [...]}}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

POOL, RAM, DISK = "pool", "ram", "disk"
TIER_MEDIA = (RAM, DISK)


@dataclass
class KVEventBatch:
    # block hash -> findable in the pool now (True) or not any more (False); the last change wins
    changes: dict[bytes, bool] = field(default_factory=dict)
    cleared: bool = False  # nothing from before this batch is findable (a snapshot)
    # The same for the tier's media (RAM, DISK); empty without a tier.
    tier_changes: dict[str, dict[bytes, bool]] = field(default_factory=dict)
    tier_id: str | None = None  # the tier's, when the engine has one

    def __bool__(self) -> bool:
        return self.cleared or bool(self.changes) or any(self.tier_changes.values())

    def apply(self, held: set[bytes], medium: str = POOL) -> None:
        """Bring `held` (the hashes a listener knows to be findable in `medium`) up to
        date."""
        if self.cleared:
            held.clear()
        changes = self.changes if medium == POOL else self.tier_changes.get(medium, {})
        for block_hash, findable in changes.items():
            if findable:
                held.add(block_hash)
            else:
                held.discard(block_hash)

    def to_json(self) -> str:
        data: dict = {"cleared": self.cleared, **_lists(self.changes)}
        if self.tier_id is not None:
            tier = {m: _lists(self.tier_changes.get(m, {})) for m in TIER_MEDIA}
            data["tier"] = {"id": self.tier_id, **tier}
        return json.dumps(data)

    @classmethod
    def from_json(cls, line: str | bytes) -> KVEventBatch:
        """Raises ValueError on a line that is not a batch."""
        try:
            data = json.loads(line)
            batch = cls(_changes(data), bool(data["cleared"]))
            tier = data.get("tier")
            if tier is not None:
                batch.tier_id = str(tier["id"])
                batch.tier_changes = {m: _changes(tier[m]) for m in TIER_MEDIA}
            return batch
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a KV event batch: {line!r:.200}") from e


def _lists(changes: dict[bytes, bool]) -> dict[str, list[str]]:
    return {
        "stored": [h.hex() for h, findable in changes.items() if findable],
        "removed": [h.hex() for h, findable in changes.items() if not findable],
    }


def _changes(lists: dict) -> dict[bytes, bool]:
    changes = {bytes.fromhex(h): False for h in lists["removed"]}
    changes.update({bytes.fromhex(h): True for h in lists["stored"]})
    return changes
