"""KV cache events: what an engine's prefix cache can find, as it changes, for a router
that sends each request where its prefix is cached (vLLM publishes the same facts as
`BlockStored` / `BlockRemoved` / `AllBlocksCleared` events).

The block pool records, while someone listens, the net change of each block hash
since the last batch: True once a full block becomes findable by its hash, False once
it stops being (evicted, or its content in doubt). A listener's first batch is a
snapshot (`cleared`, then every hash findable), so snapshot + batches is exactly the
set of hashes the cache holds. Hashes are the chained block hashes of
`kv_cache_manager.hash_block`, which a router computes from the prompt alone.

One batch per line of JSON on the wire (`GET /kv_events` of `pagoda serve`):
`{"cleared": bool, "stored": [hex, ...], "removed": [hex, ...]}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class KVEventBatch:
    # block hash -> findable now (True) or not any more (False); the last change wins
    changes: dict[bytes, bool] = field(default_factory=dict)
    cleared: bool = False  # nothing from before this batch is findable

    def __bool__(self) -> bool:
        return self.cleared or bool(self.changes)

    def apply(self, held: set[bytes]) -> None:
        """Bring `held` (the hashes a listener knows to be findable) up to date."""
        if self.cleared:
            held.clear()
        for block_hash, findable in self.changes.items():
            if findable:
                held.add(block_hash)
            else:
                held.discard(block_hash)

    def to_json(self) -> str:
        return json.dumps(
            {
                "cleared": self.cleared,
                "stored": [h.hex() for h, findable in self.changes.items() if findable],
                "removed": [h.hex() for h, findable in self.changes.items() if not findable],
            }
        )

    @classmethod
    def from_json(cls, line: str | bytes) -> KVEventBatch:
        """Raises ValueError on a line that is not a batch."""
        try:
            data = json.loads(line)
            changes = {bytes.fromhex(h): False for h in data["removed"]}
            changes.update({bytes.fromhex(h): True for h in data["stored"]})
            return cls(changes, bool(data["cleared"]))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a KV event batch: {line!r:.200}") from e
