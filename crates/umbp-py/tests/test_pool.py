"""umbp.PoolIndex and umbp.Pool: the pool's index and its data path from Python, on an
embedded index (a redb file) and on a real redis-server started by the test (skipped with the
reason printed when redis-server is absent, unless UMBP_REQUIRE_REDIS=1)."""

import os
import threading

import numpy as np
import pytest

import umbp
from redis_server import PASSWORD, redis  # noqa: F401  (the fixture)

SLOT = 4096
SLOTS = 16


def key(i):
    return int(i).to_bytes(16, "big")


@pytest.fixture(params=["embedded", "redis"])
def index(request, tmp_path):
    if request.param == "embedded":
        yield umbp.PoolIndex(str(tmp_path / "pool.redb"))
    else:
        server = request.getfixturevalue("redis")
        yield umbp.PoolIndex(server.url, prefix="pytest", timeout=2.0)


def block(i, n=SLOT):
    return ((np.arange(n, dtype=np.uint64) * 131 + i * 7919) % 251).astype(np.uint8)


# -- the index ----------------------------------------------------------------------------------


def test_index_two_phase_lease_and_generations(index):
    index.announce(1, "10.0.0.1:7000", [(0, SLOTS * SLOT)], 30.0)
    assert [n[0] for n in index.nodes()] == [1]
    index.register_tier(1, 0, SLOT, SLOTS)
    index.register_tier(1, 0, SLOT, SLOTS)  # the same shape again: a no-op
    assert index.tier_spec(1, 0)[:3] == (SLOT, SLOTS, False)
    assert index.tier_spec(1, 9) is None
    with pytest.raises(umbp.PoolError) as e:
        index.register_tier(1, 0, SLOT * 2, SLOTS)
    assert e.value.kind == "tier_conflict"

    answers = index.reserve_many(1, 0, [(key(1), 100), (key(2), SLOT + 1)], 30.0)
    r, too_large = answers
    assert isinstance(r, umbp.Reservation) and r.key == key(1) and r.length == 100
    assert isinstance(too_large, umbp.PoolError) and too_large.kind == "too_large"
    assert index.lookup([key(1)]) == [None]  # invisible until published
    [(won, p)] = index.publish([(r, 0xABCD)])
    assert won == "won" and isinstance(p, umbp.Placement)
    assert (p.key, p.slot, p.length, p.checksum, p.generation) == (key(1), r.slot, 100, 0xABCD, r.generation)
    assert index.lookup([key(1), key(3)]) == [p, None]
    assert index.prefix_hits([key(1), key(3), key(1)]) == 1

    # Already published: a second reserve answers the placement.
    [present] = index.reserve_many(1, 0, [(key(1), 100)], 30.0)
    assert present == p

    lease_id, granted = index.lease([p], 10.0)
    assert granted == [True]
    index.renew(lease_id, 10.0)
    assert index.remove([key(1)]) == ["leased"]
    index.release(lease_id)
    with pytest.raises(umbp.PoolError) as e:
        index.renew(lease_id, 10.0)
    assert e.value.kind == "lease_expired"
    assert index.remove([key(1), key(1)]) == ["removed", "absent"]

    # The slot reused under another key: the old placement is stale, its lease not granted.
    [r2] = index.reserve_many(1, 0, [(key(4), 10)], 30.0)
    assert r2.generation > p.generation
    index.publish([(r2, 1)])
    stale = umbp.Placement(key(1), p.node, p.tier, r2.slot, p.length, p.checksum, p.generation)
    lease_id, granted = index.lease([stale], 10.0)
    assert granted == [False]
    index.release(lease_id)

    # An abort frees the slot and publishes nothing.
    free_before = index.tier_stats(1, 0)[0]
    [r3] = index.reserve_many(1, 0, [(key(5), 10)], 30.0)
    assert index.tier_stats(1, 0)[0] == free_before - 1
    index.abort([r3])
    assert index.tier_stats(1, 0)[0] == free_before
    assert index.publish([(r3, 1)]) == [("expired", None)]
    assert index.lookup([key(5)]) == [None]

    assert index.leave(1) is True
    assert index.nodes() == []
    assert index.leave(1) is False


def test_index_rejects_bad_keys_and_ttls(tmp_path):
    index = umbp.PoolIndex(str(tmp_path / "pool.redb"))
    with pytest.raises(ValueError, match="16 bytes"):
        index.lookup([b"short"])
    with pytest.raises(ValueError):
        index.lease([], -1.0)
    with pytest.raises(ValueError):
        index.lease([], float("nan"))


def test_redis_wrong_password_is_a_pool_error(redis):  # noqa: F811
    with pytest.raises(umbp.PoolError) as e:
        umbp.PoolIndex(f"redis://127.0.0.1:{redis.port}/", password="wrong", timeout=2.0)
    assert e.value.kind == "unavailable"
    # The password as an argument, not in the URL.
    index = umbp.PoolIndex(f"redis://127.0.0.1:{redis.port}/", password=PASSWORD, timeout=2.0)
    assert index.lookup([key(1)]) == [None]
    assert PASSWORD not in repr(umbp.PoolIndex(redis.url, timeout=2.0))


def test_redis_entries_are_sealed_under_the_clusters_secret(redis, tmp_path):  # noqa: F811
    """A client with the cluster's secret takes only entries sealed under it for hits: those
    published by a client without it (a Redis writer with the password alone) are misses,
    and are stored anew by the client with the secret."""
    sealed = umbp.PoolIndex(redis.url, prefix="sealed", timeout=2.0, secret=b"s3cret")
    outsider = umbp.PoolIndex(redis.url, prefix="sealed", timeout=2.0)
    sealed.announce(1, "10.0.0.1:7000", [(0, SLOTS * SLOT)], 30.0)
    sealed.register_tier(1, 0, SLOT, SLOTS)
    [r] = outsider.reserve_many(1, 0, [(key(1), 100)], 30.0)
    [(won, p)] = outsider.publish([(r, 7)])
    assert won == "won" and outsider.lookup([key(1)]) == [p]
    assert sealed.lookup([key(1)]) == [None]
    assert sealed.prefix_hits([key(1)]) == 0
    [r] = sealed.reserve_many(1, 0, [(key(1), 100)], 30.0)
    assert isinstance(r, umbp.Reservation), r
    [(won, mine)] = sealed.publish([(r, 8)])
    assert won == "won" and sealed.lookup([key(1)]) == [mine]
    assert outsider.lookup([key(1)]) == [None]
    assert umbp.PoolIndex(redis.url, prefix="sealed", timeout=2.0, secret=b"s3cret").lookup(
        [key(1)]
    ) == [mine]
    with pytest.raises(ValueError, match="embedded"):
        umbp.PoolIndex(str(tmp_path / "pool.redb"), secret=b"s3cret")


# -- the pool -----------------------------------------------------------------------------------


def make_pool(index, *, node=3, checksums="all_tiers"):
    engine = umbp.Engine(checksums=checksums, workers=4)
    pool = umbp.Pool(engine, index, node=node, reservation_ttl=30.0, lease_ttl=10.0)
    arena = engine.register(np.full(SLOT * SLOTS, 0xEE, dtype=np.uint8))
    pool.add_tier(0, arena, slot_size=SLOT, slot_count=SLOTS)
    return engine, pool, arena


def test_pool_put_get_round_trip(index):
    engine, pool, _arena = make_pool(index)
    srcs = [block(i, SLOT - i) for i in range(4)]
    regs = [engine.register(s) for s in srcs]
    res = pool.put(0, [(key(i), regs[i], 0, SLOT - i) for i in range(4)])
    assert [r.status for r in res] == ["stored"] * 4, res
    assert pool.exists([key(0), key(9)]) == [True, False]
    assert pool.prefix_hits([key(0), key(1), key(9), key(2)]) == 2
    # Putting again: present, nothing written.
    assert [r.status for r in pool.put(0, [(key(0), regs[0], 0, SLOT)])] == ["present"]

    out = np.zeros(5 * SLOT, dtype=np.uint8)
    dst = engine.register(out)
    got = pool.get([(key(i), dst, i * SLOT, SLOT) for i in range(4)] + [(key(9), dst, 4 * SLOT, SLOT)])
    assert [r.status for r in got] == ["loaded"] * 4 + ["miss"], got
    for i in range(4):
        assert got[i].placement == res[i].placement
        assert bytes(engine.read(dst, i * SLOT, SLOT - i)) == srcs[i].tobytes()
    m = pool.metrics()
    assert (m["hits"], m["misses"], m["stored"], m["present"]) == (4, 1, 4, 1), m

    # A destination too small fails that block alone.
    small = pool.get([(key(0), dst, 0, 10), (key(1), dst, SLOT, SLOT)])
    assert [r.status for r in small] == ["failed", "loaded"]
    assert "room for 10" in small[0].error

    assert pool.remove([key(0), key(9)]) == ["removed", "absent"]
    assert [r.status for r in pool.get([(key(0), dst, 0, SLOT)])] == ["miss"]
    pool.close()
    pool.close()
    with pytest.raises(umbp.ClosedError):
        pool.exists([key(1)])


def test_pool_refuses_a_dram_tier_its_checksums_do_not_cover(tmp_path):
    index = umbp.PoolIndex(str(tmp_path / "pool.redb"))
    engine = umbp.Engine()  # files_and_remote: DRAM blocks would not be verified
    pool = umbp.Pool(engine, index, node=0)
    arena = engine.register(np.zeros(SLOT * SLOTS, dtype=np.uint8))
    with pytest.raises(umbp.PoolError) as e:
        pool.add_tier(0, arena, slot_size=SLOT, slot_count=SLOTS)
    assert e.value.kind == "invalid_config"
    # A registration of another engine: a ValueError before the index is touched.
    other = umbp.Pool(umbp.Engine(checksums="all_tiers"), index, node=0)
    with pytest.raises(ValueError, match="another engine"):
        other.add_tier(0, arena, slot_size=SLOT, slot_count=SLOTS)


def test_pool_ssd_tier_round_trip(tmp_path):
    index = umbp.PoolIndex(str(tmp_path / "pool.redb"))
    engine = umbp.Engine()  # files_and_remote covers the SSD tier
    pool = umbp.Pool(engine, index, node=0)
    ssd = engine.register_file(str(tmp_path / "tier.bin"), 0, SLOT * SLOTS, create=True, extend=True, direct=False)
    pool.add_tier(1, ssd, slot_size=SLOT, slot_count=SLOTS, durable=True)
    data = block(5)
    src = engine.register(data)
    assert pool.put(1, [(key(5), src, 0, SLOT)])[0].status == "stored"
    dst = engine.register(np.zeros(SLOT, dtype=np.uint8))
    assert pool.get([(key(5), dst, 0, SLOT)])[0].ok
    assert engine.read(dst, 0, SLOT) == data.tobytes()
    # A clobbered slot: a checksum failure, counted, never a hit, and the key leaves the pool.
    p = pool.index.lookup([key(5)])[0]
    engine.write(ssd, p.slot * SLOT, bytes(SLOT))
    bad = pool.get([(key(5), dst, 0, SLOT)])
    assert bad[0].status == "failed" and "checksum" in bad[0].error, bad
    assert pool.metrics()["checksum_failures"] == 1
    assert pool.exists([key(5)]) == [False]


def test_pool_sixteen_threads_overlapping_keys(index):
    engine, pool, _arena = make_pool(index)
    keys = 24  # more keys than slots: eviction runs while threads get
    datas = {i: block(i) for i in range(keys)}
    regs = {i: engine.register(datas[i]) for i in range(keys)}
    errors = []

    def worker(t):
        try:
            dst_mem = np.zeros(4 * SLOT, dtype=np.uint8)
            dst = engine.register(dst_mem)
            for round_ in range(12):
                ks = [(t * 5 + round_ * 3 + j) % keys for j in range(4)]
                put = pool.put(0, [(key(k), regs[k], 0, SLOT) for k in ks])
                for r in put:
                    assert r.status in ("stored", "present", "failed"), r
                    if r.status == "failed":
                        assert "free slot" in r.error, r  # the tier is full of leased slots
                got = pool.get([(key(k), dst, j * SLOT, SLOT) for j, k in enumerate(ks)])
                for j, (k, r) in enumerate(zip(ks, got)):
                    assert r.status in ("loaded", "miss"), r
                    if r.status == "loaded":
                        assert engine.read(dst, j * SLOT, SLOT) == datas[k].tobytes(), (t, k)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    m = pool.metrics()
    assert m["hits"] > 0 and m["checksum_failures"] == 0 and m["get_failures"] == 0, m


#: The shared secret the memory node and the engine authenticate each other with.
SECRET = b"umbp python tests: 32 bytes long"


def test_pool_reaches_a_memory_node_and_its_loss_costs_only_its_blocks(tmp_path):
    try:
        engine = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET, checksums="all_tiers")
    except umbp.Error as e:
        if os.environ.get("UMBP_REQUIRE_UCX") == "1":
            raise
        pytest.skip(f"no remote tier here: {e}")
    # The memory node: one exported region, tier 0 of node 7 in the pool.
    node_mem = np.zeros(SLOTS * SLOT, dtype=np.uint8)
    server = umbp.Server({"arena": node_mem}, transports="tcp", secret=SECRET, node=7)
    index = umbp.PoolIndex(str(tmp_path / "pool.redb"))
    index.register_tier(7, 0, SLOT, SLOTS)
    index.announce(7, server.address, [(0, SLOTS * SLOT)], 60.0)
    pool = umbp.Pool(engine, index, node=3)
    arena = engine.register(np.zeros(SLOT * SLOTS, dtype=np.uint8))
    pool.add_tier(0, arena, slot_size=SLOT, slot_count=SLOTS)

    far, near = block(1), block(2)
    src = engine.register(np.concatenate([far, near]))
    put = pool.put(0, [(key(1), src, 0, SLOT)], node=7) + pool.put(0, [(key(2), src, SLOT, SLOT)])
    assert [r.status for r in put] == ["stored", "stored"], put
    assert (put[0].placement.node, put[1].placement.node) == (7, 3)

    dst = engine.register(np.zeros(2 * SLOT, dtype=np.uint8))
    gets = [(key(1), dst, 0, SLOT), (key(2), dst, SLOT, SLOT)]
    got = pool.get(gets)
    assert [r.status for r in got] == ["loaded", "loaded"], got
    assert engine.read(dst, 0, 2 * SLOT) == far.tobytes() + near.tobytes()

    # The node goes away: its block fails (never loaded), the local one still loads.
    server.close()
    got = pool.get(gets)
    assert [r.status for r in got] == ["failed", "loaded"], got
    assert pool.metrics()["get_failures"] == 1


def test_pool_duplicate_keys_in_one_call(index):
    engine, pool, _arena = make_pool(index)
    a, b = block(1), block(2)
    src = engine.register(np.concatenate([a, b]))
    # The same key twice in one put: one publish wins, the other is "present" (its slot freed).
    put = pool.put(0, [(key(1), src, 0, SLOT), (key(1), src, SLOT, SLOT)])
    assert sorted(r.status for r in put) == ["present", "stored"], put
    assert put[0].placement == put[1].placement
    winner = a if put[0].status == "stored" else b
    assert index.tier_stats(3, 0) == (SLOTS - 1, 0, 1)
    # The same key twice in one get: both destinations get the winner's bytes.
    dst = engine.register(np.zeros(2 * SLOT, dtype=np.uint8))
    got = pool.get([(key(1), dst, 0, SLOT), (key(1), dst, SLOT, SLOT)])
    assert [r.status for r in got] == ["loaded", "loaded"], got
    assert engine.read(dst, 0, 2 * SLOT) == winner.tobytes() * 2


def test_pool_source_closed_while_threads_put_from_it(tmp_path):
    """A source registration closed by another thread while puts read from it: each put block
    is stored whole or fails (nothing published); every key reported stored loads exactly."""
    index = umbp.PoolIndex(str(tmp_path / "pool.redb"))
    engine, pool, _arena = make_pool(index)
    data = block(9, 4 * SLOT)
    src = engine.register(data)
    stored = []
    raised = []

    def putter(t):
        for i in range(40):
            k = key(1000 * t + i)
            try:
                r = pool.put(0, [(k, src, (i % 4) * SLOT, SLOT)])[0]
            except umbp.ClosedError:
                raised.append(k)  # closed before the put took its endpoint: nothing happened
                continue
            assert r.status in ("stored", "failed"), r
            if r.status == "stored":
                stored.append((k, (i % 4) * SLOT))
            else:
                assert pool.exists([k]) == [False]

    threads = [threading.Thread(target=putter, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    src.close()  # waits for the batches using it
    for t in threads:
        t.join()
    for k in raised:
        assert pool.exists([k]) == [False]
    dst = engine.register(np.zeros(SLOT, dtype=np.uint8))
    for k, offset in stored:
        r = pool.get([(k, dst, 0, SLOT)])[0]
        # Evicted by later puts (16 slots) is a miss; what loads is the source's bytes exactly.
        assert r.status in ("loaded", "miss"), r
        if r.ok:
            assert engine.read(dst, 0, SLOT) == data[offset : offset + SLOT].tobytes()
    assert pool.metrics()["checksum_failures"] == 0


def test_pool_leave_withdraws_the_node_for_other_instances(redis):  # noqa: F811
    index = umbp.PoolIndex(redis.url, prefix="leave", timeout=2.0)
    engine, pool, _arena = make_pool(index, node=3)
    src = engine.register(block(1))
    assert pool.put(0, [(key(1), src, 0, SLOT)])[0].status == "stored"
    other = umbp.PoolIndex(redis.url, prefix="leave", timeout=2.0)
    assert other.lookup([key(1)])[0] is not None
    assert pool.leave() is True
    assert other.lookup([key(1)]) == [None]
    assert [n[0] for n in other.nodes()] == []
    assert pool.put(0, [(key(2), src, 0, SLOT)])[0].status == "failed"


def test_pool_ssd_blocks_survive_a_restart(tmp_path):
    """An instance with an embedded index and a durable SSD tier stops and starts again (a new
    engine, index and pool over the same files): what it stored loads byte for byte."""
    path, tier_file = str(tmp_path / "pool.redb"), str(tmp_path / "tier.bin")
    datas = [block(i) for i in range(3)]

    def start():
        engine = umbp.Engine()
        index = umbp.PoolIndex(path)
        pool = umbp.Pool(engine, index, node=0)
        ssd = engine.register_file(tier_file, 0, SLOT * SLOTS, create=True, extend=True, direct=False)
        pool.add_tier(1, ssd, slot_size=SLOT, slot_count=SLOTS, durable=True)
        return engine, pool

    engine, pool = start()
    src = engine.register(np.concatenate(datas))
    put = pool.put(1, [(key(i), src, i * SLOT, SLOT) for i in range(3)])
    assert [r.status for r in put] == ["stored"] * 3, put
    pool.close()
    del engine, pool, src

    engine, pool = start()
    assert pool.prefix_hits([key(0), key(1), key(2), key(3)]) == 3
    dst = engine.register(np.zeros(3 * SLOT, dtype=np.uint8))
    got = pool.get([(key(i), dst, i * SLOT, SLOT) for i in range(3)])
    assert [r.status for r in got] == ["loaded"] * 3, got
    assert engine.read(dst, 0, 3 * SLOT) == b"".join(d.tobytes() for d in datas)


def test_umbp_exports_the_pools_names_from_the_one_list_in_umbp_pool():
    """umbp.pool.__all__ is the one list of the pool's public names: umbp re-exports each of
    them (the same objects) and lists them in its own __all__, once."""
    import umbp.pool

    assert umbp.pool.__all__, "umbp.pool lists its public names"
    for name in umbp.pool.__all__:
        assert getattr(umbp, name) is getattr(umbp.pool, name), name
        assert umbp.__all__.count(name) == 1, name
    assert len(umbp.__all__) == len(set(umbp.__all__))
    assert [n for n in umbp.__all__ if not hasattr(umbp, n)] == []
