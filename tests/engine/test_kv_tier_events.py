"""KV events that name the tier a block lives in (pool, the tier's RAM part, its files),
and a router that scores replicas by it: a block in a shared tier counts, for a little
less than one in the pool, for every replica on that tier."""

from __future__ import annotations

import os
import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.core.kv_events import DISK, POOL, RAM, KVEventBatch
from pagoda.core.kv_tier import KVTier, fingerprint
from pagoda.entrypoints.router import Router, RouterConfig
from pagoda.entrypoints.router.prefix_table import PrefixTable
from tests.helpers import tiny_prompts

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # the tiny model's, float32: layers, K/V, kv heads, head_dim
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def tier_on(folder, max_bytes: int, ram_bytes: int = 0) -> KVTier:
    """A tier whose block `i` holds 100 bytes of `i`."""
    read = lambda ids: [bytes([i]) * 100 for i in ids]  # noqa: E731
    return KVTier(str(folder), max_bytes, fingerprint("m"), read, ram_bytes)


def test_tier_events_follow_the_tier_exactly(tmp_path):
    """A listener that applies the snapshot and every batch knows exactly what the tier
    can find, per medium, whatever it did between batches: writes, the byte budget's
    evictions, the RAM part's, reads, damaged files, another server's files."""
    rng = random.Random(0)
    tier = tier_on(tmp_path, max_bytes=12 * (100 + 53), ram_bytes=5 * 100)
    other = tier_on(tmp_path, max_bytes=1 << 20)  # another server on the same folder
    assert tier.tier_id == other.tier_id != tier_on(tmp_path / "b", max_bytes=1).tier_id
    tier.save(b"early".ljust(16), 1)
    tier.flush()
    snapshot = tier.start_events()
    held = {medium: set(snapshot[medium]) for medium in (RAM, DISK)}
    assert held[DISK] == {b"early".ljust(16)}

    def files() -> set[bytes]:
        return {bytes.fromhex(f[:-3]) for f in os.listdir(tier.folder) if f.endswith(".kv")}

    for _ in range(300):
        block_hash = bytes([rng.randrange(40)]).ljust(16, b"h")
        op = rng.random()
        if op < 0.5:
            tier.save(block_hash, rng.randrange(256))
        elif op < 0.75:
            tier.stage([block_hash])
            tier.drop_staged()
        elif op < 0.85 and (names := sorted(files())):
            with open(os.path.join(tier.folder, rng.choice(names).hex() + ".kv"), "r+b") as f:
                f.write(b"garbage")  # found damaged (and removed) on its next read
        else:
            other.save(block_hash, 7)  # the tier learns of it when it reads it
            other.flush()
        tier.flush()
        tier.take_saved()
        for medium, changes in tier.take_events().items():
            for h, findable in changes.items():
                (held[medium].add if findable else held[medium].discard)(h)
        assert held[RAM] == set(tier._ram)
        # Every file is known, save those another server wrote and this one never read.
        assert held[DISK] <= files() and set(tier._index) <= held[DISK]
    tier.stop_events()
    assert tier.take_events() == {}
    tier.close()
    other.close()


def test_events_cross_the_wire_with_their_media():
    batch = KVEventBatch(
        {b"\x01": True, b"\x02": False},
        cleared=True,
        tier_changes={RAM: {b"\x03": True}, DISK: {b"\x04": True, b"\x05": False}},
        tier_id="ab12",
    )
    again = KVEventBatch.from_json(batch.to_json())
    assert again == batch
    plain = KVEventBatch({b"\x01": True})
    assert KVEventBatch.from_json(plain.to_json()) == plain  # no tier: as before
    assert KVEventBatch(tier_changes={DISK: {b"\x01": False}}, tier_id="x")  # a change
    with pytest.raises(ValueError, match="not a KV event batch"):
        KVEventBatch.from_json('{"cleared": false, "stored": [], "removed": [], "tier": {}}')


def test_the_table_weighs_blocks_by_where_they_are():
    table = PrefixTable(1000)
    hashes = [bytes([i]) for i in range(4)]
    # Replicas 0 and 1 share tier "t"; replica 2 reads tier "u".
    for replica, tier in [(0, "t"), (1, "t"), (2, "u")]:
        table.apply(KVEventBatch(cleared=True, tier_id=tier), replica)
    table.apply(KVEventBatch({h: True for h in hashes[:2]}, tier_id="t"), 0)
    table.apply(KVEventBatch(tier_changes={RAM: {hashes[0]: True}}, tier_id="t"), 1)
    table.apply(KVEventBatch(tier_changes={DISK: dict.fromkeys(hashes, True)}, tier_id="t"), 0)
    assert table.matched(hashes, 0) == [POOL, POOL, DISK, DISK]
    assert table.matched(hashes, 1) == [RAM, DISK, DISK, DISK]  # the files replica 0 wrote
    assert table.matched(hashes, 2) == []
    assert table.score(hashes, 0) > table.score(hashes, 1) > table.score(hashes, 2) == 0
    # A replica that went down loses its pool and RAM, not its tier's files.
    table.forget(0)
    assert table.matched(hashes, 1) == [RAM, DISK, DISK, DISK] and table.matched(hashes, 0) == []
    # A snapshot lists the tier's whole directory: it replaces what the table knew of it.
    table.apply(KVEventBatch(cleared=True, tier_changes={DISK: {hashes[0]: True}}, tier_id="t"), 0)
    assert table.matched(hashes, 0) == [DISK] and table.matched(hashes, 1) == [RAM]


def test_the_router_follows_blocks_into_a_shared_tier(tiny_llama, tmp_path):
    """Three engines' real events through the wire format: a and b on one tier folder,
    c on its own with a RAM part. A prompt a answered is in a's pool and in the shared
    files: the router sends it to a, though a is busier. Once a's pool lets it go, a
    and b find it alike (the files), and the less busy b gets it and answers it from
    the tier with a's tokens. c's blocks leave its pool for its RAM part, and count
    for c alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = [t for p in tiny_prompts(tokenizer, 12) for t in p][: 6 * BS + 5]
    others = [(p * 8)[: 6 * BS] for p in tiny_prompts(tokenizer, 6, seed=5)]
    engine = lambda folder, **kw: LLM(model=tiny_llama, kv_offload_dir=str(folder), block_size=BS,  # noqa: E731
                                      kv_cache_memory_bytes=16 * BLOCK_BYTES, dtype="float32", **kw)  # fmt: skip
    engines = [engine(tmp_path / "shared"), engine(tmp_path / "shared"),
               engine(tmp_path / "own", kv_offload_ram_bytes=1 << 20)]  # fmt: skip
    kv = [llm.llm_engine.kv_cache_manager for llm in engines]
    router = Router(RouterConfig(backends=("http://a", "http://b", "http://c"), block_size=BS))
    a, b, c = router.replicas

    def follow(batches) -> None:  # as `GET /kv_events` carries them
        for replica, batch in zip(router.replicas, batches, strict=True):
            if batch:
                router.apply_kv_events(replica, 0, KVEventBatch.from_json(batch.to_json()))

    follow([m.start_kv_events() for m in kv])

    def answer(llm, tokens: list[int]):
        out = llm.generate([{"prompt_token_ids": tokens}], GREEDY, use_tqdm=False)[0]
        llm.llm_engine.kv_tier.flush()
        follow([m.take_kv_events() for m in kv])
        return out

    first = answer(engines[0], prompt)
    hashes = router.block_hashes({"prompt": prompt})[:6]
    where = lambda replica: router.table.matched(hashes, replica.index)  # noqa: E731
    assert where(a) == [POOL] * 6 and where(b) == [DISK] * 6 and where(c) == []
    a.in_flight = 1
    assert router.choose(hashes) is a  # busier, but it holds the prefix best
    for other in others:  # a's pool lets the prompt's blocks go
        answer(engines[0], other)
    assert where(a) == where(b) == [DISK] * 6
    assert router.choose(hashes) is b  # as good a hit, less busy
    again = answer(engines[1], prompt)
    assert again.num_cached_tokens == 6 * BS
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert where(b) == [POOL] * 6
    for tokens in [prompt, *others]:
        answer(engines[2], tokens)
    assert where(c) == [RAM] * 6 and where(a) == [DISK] * 6  # c's tier is c's
    for m in kv:
        m.stop_kv_events()
        assert m.take_kv_events() is None


def test_an_idle_engine_sends_what_its_tier_wrote(tiny_llama, tmp_path):
    """The tier's writer works after the step that finished a request: a listener hears
    of the files it wrote though no further request comes (an idle engine sends its
    tier's events every KVEventListeners.TIER_EVENTS_S)."""
    import asyncio

    from transformers import AutoTokenizer

    from pagoda import EngineArgs
    from pagoda.core.kv_cache_manager import hash_block
    from pagoda.engine.async_engine import AsyncEngine

    tokens = [t for p in tiny_prompts(AutoTokenizer.from_pretrained(tiny_llama), 12) for t in p]
    prompt = tokens[: 6 * BS + 5]
    hashes, parent = [], None
    for start in range(0, 6 * BS, BS):
        parent = hash_block(parent, prompt[start : start + BS])
        hashes.append(parent)
    engine = AsyncEngine.from_engine_args(
        EngineArgs(model=tiny_llama, kv_offload_dir=str(tmp_path), block_size=BS)
    )

    async def scenario() -> None:
        stream = engine.listen_kv_events()
        on_disk: set[bytes] = set()
        (await stream.__anext__()).apply(on_disk, DISK)  # the snapshot: nothing yet
        assert not on_disk
        async for _ in engine.generate({"prompt_token_ids": prompt}, GREEDY):
            pass
        while not set(hashes) <= on_disk:
            (await asyncio.wait_for(stream.__anext__(), 10)).apply(on_disk, DISK)
        engine.stop_kv_events(stream)

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
