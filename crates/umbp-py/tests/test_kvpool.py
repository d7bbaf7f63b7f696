"""umbp.kvpool: the pool as the index of umbp.vllm's scheduler side, over a real
umbp.PoolIndex (an embedded redb file, or a redis-server started here). No vLLM needed."""

import gc
import os
import time

import pytest

from umbp import _native
from umbp.kvpool import (
    REMOTE,
    SAVE_MEMORY_NODES,
    SAVE_MEMORY_NODES_ONLY,
    SSD,
    PoolTierIndex,
    pool_key,
    tier_id,
)
from redis_server import redis  # noqa: F401  (the fixture)

SLOT = 4096
OBJECT = 4000


def pool_index(client, node=1, *, ranks=2, slots=8, ns=b"model-a", host="host-1", **kw):
    return PoolTierIndex(
        client,
        node=node,
        ranks=ranks,
        slot_bytes=SLOT,
        object_bytes=OBJECT,
        dram_slots=0,
        ssd_slots=slots,
        ssd_files=[f"/nvme/kv-{node}.rank{r}" for r in range(ranks)],
        namespace=ns,
        host=host,
        **kw,
    )


def crc(key, rank):
    """The checksum a rank's save of ``key`` reports in these tests."""
    return (hash((key, rank)) & 0xFFFFFFFF) or 1


def save(ix, keys, fail_rank=None):
    """Plans, reserves, reports (every rank ok, or ``fail_rank`` failed) and publishes saves
    of ``keys``; returns {key: refs} of those that got slots."""
    ops = {k: ix.begin_save(k)[0] for k in keys}
    refs = ix.commit()
    for k, op in ops.items():
        if op not in refs:
            continue
        for r in range(ix.ranks):
            if r == fail_rank:
                ix.report(op, failed=1)
            else:
                ix.report(op, ok=1, checksums={r: crc(k, r)})
    ix.flush()
    return {k: refs[op] for k, op in ops.items() if op in refs}


def load(ix, keys, fail=()):
    """Plans loads of ``keys`` (after count_hits found them), commits (one lease) and
    reports as the workers would: a rank told slot -1 fails the block, the others complete
    it (or fail it, for ``fail``); returns {key: refs}."""
    ops = {k: ix.begin_load(k)[0] for k in keys}
    refs = ix.commit()
    for k, op in ops.items():
        for ref in refs[op]:
            bad = k in fail or ref[2] < 0
            ix.report(op, ok=0 if bad else 1, failed=1 if bad else 0)
    ix.flush()
    return {k: refs[op] for k, op in ops.items()}


@pytest.fixture
def embedded(tmp_path):
    return _native.PoolIndex(str(tmp_path / "pool.redb"))


def test_a_block_is_published_only_when_every_rank_saved_it_with_that_ranks_checksum(embedded):
    ix = pool_index(embedded)
    keys = [b"h%d" % i for i in range(3)]
    ops = {k: ix.begin_save(k)[0] for k in keys}
    refs = ix.commit()
    assert set(refs) == set(ops.values())
    for k, op in ops.items():
        ix.report(op, ok=1, checksums={0: crc(k, 0)})
    ix.flush()
    assert ix.count_hits(keys) == 0  # rank 1 has not reported: nothing is visible
    for k, op in ops.items():
        ix.report(op, ok=1, checksums={1: crc(k, 1)})
    ix.flush()
    assert ix.count_hits(keys) == 3 and ix.counters.published == 3
    # Each rank's shard is a block of its own, in its rank's tier, with its own checksum.
    for k in keys:
        found = embedded.lookup(ix.keys_of(k))
        assert [p.tier for p in found] == [tier_id(0, SSD), tier_id(1, SSD)]
        assert [p.checksum for p in found] == [crc(k, 0), crc(k, 1)]
        assert all(p.node == 1 and p.length == OBJECT for p in found)
    # What the workers are told to load: each rank's slot and checksum, from its own tier.
    got = load(ix, keys[:2])
    for k in keys[:2]:
        found = embedded.lookup(ix.keys_of(k))
        assert got[k] == [(None, 0, p.slot, p.checksum) for p in found]
    assert ix.pending_ops() == 0


def test_a_save_that_failed_on_one_rank_publishes_nothing_and_frees_every_ranks_slot(embedded):
    ix = pool_index(embedded, slots=4)
    save(ix, [b"a", b"b"], fail_rank=1)
    assert ix.count_hits([b"a"]) == 0 and ix.counters.failed_saves == 2
    for r in range(2):
        assert embedded.tier_stats(1, tier_id(r, SSD)) == (4, 0, 0)
    # fail_save (a block computed over a failed load): never published, whatever the ranks
    # report, and the key can be saved anew at once.
    op = ix.begin_save(b"c")[0]
    ix.commit()
    assert ix.fail_save(op)
    again = ix.begin_save(b"c")
    assert again is not None
    for r in range(2):
        ix.report(op, ok=1, checksums={r: 7})
    ix.flush()
    assert ix.count_hits([b"c"]) == 0
    assert embedded.lookup(ix.keys_of(b"c")) == [None, None]
    ix.commit()
    for r in range(2):
        ix.report(again[0], ok=1, checksums={r: 9})
    ix.flush()
    assert ix.count_hits([b"c"]) == 1


def test_a_placement_reused_under_a_new_generation_is_a_load_error_never_other_bytes(embedded):
    ix = pool_index(embedded, slots=1, ranks=1)
    save(ix, [b"old"])
    assert ix.count_hits([b"old"]) == 1  # the lookup's placement, then the slot is reused
    assert embedded.remove(ix.keys_of(b"old")) == ["removed"]
    other = pool_index(embedded, 1, slots=1, ranks=1)
    save(other, [b"new"])
    [old_slot] = [p.slot for p in embedded.lookup(other.keys_of(b"new"))]
    got = load(ix, [b"old"])
    # The lease on the stale generation is refused: every rank fails the block (slot -1),
    # nothing is read from the slot that now holds b"new".
    assert got[b"old"] == [(None, 0, -1, None)] and old_slot == 0
    assert ix.counters.leases_refused == 1 and ix.counters.failed_loads == 1


def test_another_instance_on_the_host_reads_its_files_others_do_not(embedded):
    a = pool_index(embedded, 1)
    save(a, [b"x", b"y"])
    b = pool_index(embedded, 2)
    assert b.count_hits([b"x", b"y", b"z"]) == 2
    got = load(b, [b"x"])
    found = embedded.lookup(b.keys_of(b"x"))
    assert got[b"x"] == [
        (f"/nvme/kv-1.rank{r}", 8 * SLOT, found[r].slot, crc(b"x", r)) for r in range(2)
    ]
    # Another host cannot open instance 1's files; another model or shape never shares keys.
    assert pool_index(embedded, 3, host="host-2").count_hits([b"x"]) == 0
    assert pool_index(embedded, 4, ns=b"model-b").count_hits([b"x"]) == 0
    assert pool_key(b"model-a", b"x", 0) != pool_key(b"model-b", b"x", 0)
    assert pool_key(b"model-a", b"x", 0) != pool_key(b"model-a", b"x", 1)


def test_a_load_that_failed_removes_the_block_once_its_lease_ends(embedded):
    ix = pool_index(embedded)
    save(ix, [b"a", b"b"])
    assert ix.count_hits([b"a", b"b"]) == 2
    load(ix, [b"a", b"b"], fail={b"a"})
    assert ix.counters.failed_loads == 1
    assert embedded.lookup(ix.keys_of(b"a")) == [None, None]  # not trusted again
    assert ix.count_hits([b"b"]) == 1


def test_an_unreachable_redis_costs_hits_and_saves_only_and_all_resumes(tmp_path, redis):
    client = _native.PoolIndex(redis.url, timeout=1.0)
    ix = pool_index(client, announce_s=0.6)
    ix.start()
    try:
        save(ix, [b"a"])
        assert ix.count_hits([b"a"]) == 1
        ops = {k: ix.begin_save(k)[0] for k in [b"b"]}
        ix.commit()  # reserved; Redis dies before the publish
        redis.kill()
        for op in ops.values():
            for r in range(2):
                ix.report(op, ok=1, checksums={r: 5})
        ix.flush()
        assert ix.counters.failed_saves == 1 and ix.counters.index_errors >= 1
        assert ix.count_hits([b"a"]) == 0  # a miss, not an exception
        assert save(ix, [b"c"]) == {} and ix.pending_ops() == 0
        redis.start()  # empty: the renewal thread announces the node and its tiers again
        deadline = time.monotonic() + 30
        while not save(ix, [b"d"]):
            assert time.monotonic() < deadline, "saves did not resume"
            time.sleep(0.1)
        assert ix.count_hits([b"d"]) == 1
    finally:
        ix.close()


def announce_memory_node(index, node=77, *, slots=8, slot=SLOT, address="127.0.0.1:7400"):
    """A memory node as umbp-ucx-serve joins the pool: its first region is tier 0 and its
    address is ``host:port`` (the index's view only: no bytes move in these tests)."""
    index.register_tier(node, 0, slot, slots)
    index.announce(node, address, [(0, slots * slot)], 60.0)


def test_saves_go_to_a_memory_node_and_every_instance_that_reaches_it_loads_them(embedded):
    announce_memory_node(embedded)
    a = pool_index(embedded, 1, memory_nodes=True, save_to=SAVE_MEMORY_NODES)
    refs = save(a, [b"x", b"y"])
    where = "ucx://127.0.0.1:7400/0/4096"
    for k, rs in refs.items():
        found = embedded.lookup(a.keys_of(k))
        assert [(p.node, p.tier) for p in found] == [(77, 0), (77, 0)]
        assert rs == [(where, 8 * SLOT, p.slot, None) for p in found]
    assert a.counters.saves[REMOTE] == 2 and a.counters.saves[SSD] == 0
    assert a.counters.published == 2 and a.counters.fell_back == 0
    # Another instance, on another host too (a memory node is reached over the network),
    # loads them from the node: each rank its own slot, with the checksum its shard has.
    b = pool_index(embedded, 2, host="host-2", memory_nodes=True)
    assert b.count_hits([b"x", b"y", b"z"]) == 2
    got = load(b, [b"x"])
    found = embedded.lookup(b.keys_of(b"x"))
    assert got[b"x"] == [(where, 8 * SLOT, p.slot, crc(b"x", r)) for r, p in enumerate(found)]
    assert b.counters.hits[REMOTE] == 1
    # An instance that cannot reach memory nodes (no secret) does not count them as hits.
    assert pool_index(embedded, 3, host="host-2").count_hits([b"x"]) == 0


def test_one_steps_saves_spread_over_the_memory_nodes_by_free_bytes(embedded):
    """Issue 42: every save of a step went to the node with the most free bytes at its last
    announcement. Two nodes with the same room share a step's saves; a node with three times
    the room of another takes about three times the saves; a node that fills up passes the
    rest to the others."""
    announce_memory_node(embedded, 77, slots=64, address="127.0.0.1:7400")
    announce_memory_node(embedded, 78, slots=64, address="127.0.0.1:7401")
    a = pool_index(embedded, 1, ranks=1, memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY)
    refs = save(a, [bytes([i]) for i in range(16)])
    nodes = [embedded.lookup(a.keys_of(k))[0].node for k in refs]
    assert len(refs) == 16 and sorted(nodes) == [77] * 8 + [78] * 8, nodes
    # Nodes announce their free bytes: 77 and 78 have 56 slots left, 79 96, 80 32. The step's
    # 96 saves fill 79 down to the others' level first, then spread over all of them.
    for node, port in ((77, 7400), (78, 7401)):
        embedded.announce(node, f"127.0.0.1:{port}", [(0, 56 * SLOT)], 60.0)
    announce_memory_node(embedded, 79, slots=96, address="127.0.0.1:7402")
    announce_memory_node(embedded, 80, slots=32, address="127.0.0.1:7403")
    b = pool_index(embedded, 2, ranks=1, memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY)
    refs = save(b, [b"b" + bytes([i]) for i in range(96)])
    nodes = [embedded.lookup(b.keys_of(k))[0].node for k in refs]
    count = {n: nodes.count(n) for n in (77, 78, 79, 80)}
    assert len(refs) == 96, count
    assert count[79] > count[77] > 0 and count[79] > count[80], count
    assert abs(count[77] - count[78]) <= 1, count
    # A node fuller than announced (its free bytes are stale): its saves go elsewhere.
    announce_memory_node(embedded, 81, slots=2, address="127.0.0.1:7404")
    embedded.announce(81, "127.0.0.1:7404", [(0, 1000 * SLOT)], 60.0)
    c = pool_index(embedded, 3, ranks=1, memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY)
    refs = save(c, [b"c" + bytes([i]) for i in range(8)])
    nodes = [embedded.lookup(c.keys_of(k))[0].node for k in refs]
    assert len(refs) == 8 and nodes.count(81) == 2, nodes
    assert c.counters.no_room == 0


def test_without_a_memory_node_with_room_saves_fall_back_or_are_skipped_per_block(embedded):
    # No memory node at all: "memory_nodes" saves into the instance's own tier, counted;
    # "memory_nodes_only" skips them, counted, and holds nothing.
    fallback = pool_index(embedded, 1, memory_nodes=True, save_to=SAVE_MEMORY_NODES)
    refs = save(fallback, [b"a"])
    assert [r[0] for r in refs[b"a"]] == [None, None]
    assert fallback.counters.fell_back == 1 and fallback.counters.saves[SSD] == 1
    assert fallback.count_hits([b"a"]) == 1
    only = pool_index(embedded, 2, memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY)
    assert save(only, [b"b"]) == {} and only.counters.no_room == 1
    assert only.pending_ops() == 0 and only.count_hits([b"b"]) == 0
    # A node whose slots are too small for the block, and one with a single slot (rank 0
    # gets it, rank 1 finds the tier full): no room either, and the slot rank 0 had is free
    # again once flushed.
    announce_memory_node(embedded, 78, slot=OBJECT // 2, address="127.0.0.1:7401")
    announce_memory_node(embedded, 79, slots=1, address="127.0.0.1:7402")
    only = pool_index(embedded, 3, memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY)
    assert save(only, [b"c"]) == {} and only.counters.no_room == 1
    assert embedded.tier_stats(79, 0) == (1, 0, 0)
    # With room for one block on the node, a TP-1 instance saves there.
    one = pool_index(embedded, 4, ranks=1, memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY)
    assert save(one, [b"d"])[b"d"][0][0] == "ucx://127.0.0.1:7402/0/4096"
    assert embedded.tier_stats(79, 0) == (0, 0, 1)


def test_an_index_refuses_memory_node_saves_it_cannot_make(embedded):
    with pytest.raises(ValueError, match="needs memory_nodes"):
        pool_index(embedded, save_to=SAVE_MEMORY_NODES)
    with pytest.raises(ValueError, match="save_to must be one of"):
        pool_index(embedded, save_to="anywhere")
    # Only "memory_nodes_only" may have no tier of its own.
    PoolTierIndex(
        embedded, node=5, ranks=1, slot_bytes=SLOT, object_bytes=OBJECT, dram_slots=0,
        ssd_slots=0, namespace=b"m", memory_nodes=True, save_to=SAVE_MEMORY_NODES_ONLY,
    )
    with pytest.raises(ValueError, match="hold no slot"):
        PoolTierIndex(
            embedded, node=6, ranks=1, slot_bytes=SLOT, object_bytes=OBJECT, dram_slots=0,
            ssd_slots=0, namespace=b"m", memory_nodes=True, save_to=SAVE_MEMORY_NODES,
        )


# -- the reconcile at start: the embedded index against this node's SSD files ---------------


def crc32c(data):
    """CRC32C (Castagnoli), what the pool verifies blocks with (bitwise: the tests' blocks
    are few and small)."""
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
    return c ^ 0xFFFFFFFF


def block_bytes(key, rank):
    return (key + b"/%d/" % rank) * (OBJECT // (len(key) + 3)) + b"\0" * (
        OBJECT % (len(key) + 3)
    )


def files_of(tmp_path, ranks=2):
    return [str(tmp_path / f"kv.rank{r}") for r in range(ranks)]


def ssd_index(client, files, **kw):
    return PoolTierIndex(
        client,
        node=7,
        ranks=len(files),
        slot_bytes=SLOT,
        object_bytes=OBJECT,
        dram_slots=0,
        ssd_slots=8,
        ssd_files=files,
        namespace=b"model-a",
        **kw,
    )


def save_written(ix, files, keys):
    """Saves ``keys`` as the workers would: each rank writes its block's bytes into its slot
    of its SSD file and reports their CRC32C. Returns {key: slot of each rank}."""
    for f in files:
        with open(f, "ab") as fh:
            fh.truncate(8 * SLOT)
    ops = {k: ix.begin_save(k)[0] for k in keys}
    refs = ix.commit()
    slots = {}
    for k, op in ops.items():
        slots[k] = [ref[2] for ref in refs[op]]
        for r, slot in enumerate(slots[k]):
            data = block_bytes(k, r)
            with open(files[r], "r+b") as fh:
                fh.seek(slot * SLOT)
                fh.write(data)
            ix.report(op, ok=1, checksums={r: crc32c(data)})
    ix.flush()
    assert ix.counters.published == len(keys)
    return slots


def reopen(tmp_path, files, **kw):
    """Opens the embedded index and the connector's index over it again, as the connector
    does at start (the caller closed and dropped both, as a stopped process would)."""
    gc.collect()
    client = _native.PoolIndex(str(tmp_path / "pool.redb"))
    return client, ssd_index(client, files, **kw)


KEYS = [b"blk%d" % i for i in range(6)]


def test_reopened_over_a_truncated_ssd_file_the_blocks_past_its_end_are_misses(tmp_path):
    files = files_of(tmp_path)
    client = _native.PoolIndex(str(tmp_path / "pool.redb"))
    ix = ssd_index(client, files)
    slots = save_written(ix, files, KEYS)
    del client
    # The crash: rank 0's file keeps its first 3 slots only.
    with open(files[0], "r+b") as fh:
        fh.truncate(3 * SLOT)
    ix.close()
    del ix
    client, ix = reopen(tmp_path, files)
    gone = {k for k in KEYS if slots[k][0] >= 3}
    assert gone and len(gone) < len(KEYS)
    for k in KEYS:
        assert ix.is_hit(k) == (k not in gone), k
    # Rank 0's part of each block gone is dropped, as past the file's end; the rest is kept.
    report = ix.reconciled
    assert report is not None
    dropped = {(p.key, reason) for p, reason, _ in report.dropped}
    assert dropped == {(ix.keys_of(k)[0], "past_end") for k in gone}
    assert all(d == f"the file is {3 * SLOT} bytes" for _, _, d in report.dropped)
    assert report.kept == 2 * len(KEYS) - len(gone)
    # The blocks left load, and a lost one can be saved again.
    got = load(ix, [k for k in KEYS if k not in gone])
    assert all(ref[2] >= 0 for refs in got.values() for ref in refs)
    assert ix.counters.failed_loads == 0
    lost = sorted(gone)[0]
    assert ix.begin_save(lost) is not None


def test_reopened_over_a_replaced_ssd_file_the_blocks_whose_bytes_changed_are_misses(tmp_path):
    files = files_of(tmp_path)
    client = _native.PoolIndex(str(tmp_path / "pool.redb"))
    ix = ssd_index(client, files)
    slots = save_written(ix, files, KEYS)
    del client
    # The crash: rank 1's file replaced by another of the same length, in which the slots of
    # two blocks hold other bytes.
    changed = set(KEYS[1:3])
    with open(files[1], "rb") as fh:
        content = bytearray(fh.read())
    for k in changed:
        at = slots[k][1] * SLOT
        content[at : at + OBJECT] = block_bytes(b"other", 1)
    with open(files[1] + ".new", "wb") as fh:
        fh.write(content)
    os.replace(files[1] + ".new", files[1])
    ix.close()
    del ix
    client, ix = reopen(tmp_path, files)
    for k in KEYS:
        assert ix.is_hit(k) == (k not in changed), k
    report = ix.reconciled
    assert {(p.key, reason) for p, reason, _ in report.dropped} == {
        (ix.keys_of(k)[1], "checksum_mismatch") for k in changed
    }
    assert report.kept == 2 * len(KEYS) - len(changed)
    assert report.verified == report.kept and report.bytes_read > 0
    # verify="none" reads nothing: a file of the right length is trusted until a load.
    with open(files[1], "r+b") as fh:
        fh.seek(slots[KEYS[0]][1] * SLOT)
        fh.write(b"x" * 16)
    ix.close()
    del ix, client
    client, ix = reopen(tmp_path, files, verify="none")
    assert ix.is_hit(KEYS[0]) and ix.reconciled.bytes_read == 0


def test_reconcile_of_the_index_itself_and_its_refusals(tmp_path, redis):
    files = files_of(tmp_path, ranks=1)
    client = _native.PoolIndex(str(tmp_path / "pool.redb"))
    assert client.embedded
    ix = ssd_index(client, files)
    save_written(ix, files, KEYS[:2])
    with pytest.raises(ValueError, match="verify must be"):
        client.reconcile([(7, tier_id(0, SSD), SLOT, 8, files[0], 0)], "some")
    # A missing file: every block of its tier goes, with the open's error.
    os_path = tmp_path / "kv.rank0"
    os_path.unlink()
    report = client.reconcile([(7, tier_id(0, SSD), SLOT, 8, files[0], 0)], "full")
    assert [r for _, r, _ in report.dropped] == ["file_missing"] * 2 and report.kept == 0
    assert "ReconcileReport(kept=0" in repr(report)
    assert client.lookup(ix.keys_of(KEYS[0])) == [None]
    # A Redis index's blocks are in other nodes' files: refused, with a kind.
    shared = _native.PoolIndex(redis.url, timeout=1.0)
    assert not shared.embedded
    with pytest.raises(_native.PoolError) as e:
        shared.reconcile([(7, tier_id(0, SSD), SLOT, 8, files[0], 0)])
    assert e.value.kind == "unsupported"
    ix.close()
