"""What a new user meets in the first hour (issue 44, "the frictions on the way"): each test
pins one of them down as the documented behaviour."""

import errno
import gc
import os
import threading

import numpy as np
import pytest

import umbp

PAGE = 64 << 10


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


# -- Range(-1, ...) is refused when made, not when a batch carrying it starts ---------------


@pytest.mark.parametrize(
    "args",
    [
        (-1, PAGE, 0, 0),
        (0, -PAGE, 0, 0),
        (0, PAGE, 0, -1),
        (0, PAGE, 0, 0, -1),
        (0, PAGE, 0, 0, 1 << 32),
        (1 << 64, PAGE, 0, 0),
        (0, PAGE, -3, 0),
        (0.5, PAGE, 0, 0),
    ],
)
def test_a_range_no_batch_could_carry_is_refused_when_made(args):
    with pytest.raises(ValueError, match="Range"):
        umbp.Range(*args)


def test_an_object_no_batch_could_carry_is_refused_when_made():
    for kwargs in [dict(tag=-1), dict(page_size=-PAGE), dict(size=-1), dict(checksum=-1)]:
        fields = dict(tag=1, tier=0, page_offsets=[0], page_size=PAGE, size=PAGE)
        fields.update(kwargs)
        with pytest.raises(ValueError, match="Object"):
            umbp.Object(**fields)
    # Numpy integers are integers.
    r = umbp.Range(np.uint64(PAGE), np.int64(PAGE), 0, np.int32(0), group=np.uint32(2))
    assert (r.offset, r.group) == (PAGE, 2)


# -- dir(umbp) lists the package's own names -------------------------------------------------


def test_dir_lists_the_public_api_and_no_typing_names():
    public = {n for n in dir(umbp) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(umbp, n)).__name__ == "module"}
    assert public - submodules == set(umbp.__all__) - {"__version__"}, public ^ set(umbp.__all__)
    for leaked in ["Optional", "List", "Dict", "Any", "Union", "cast", "dataclass", "annotations"]:
        assert leaked not in public
    assert all(hasattr(umbp, n) for n in umbp.__all__)


# -- device memory takes a label, and errors name it -----------------------------------------


def test_device_memory_is_called_by_its_label_in_errors():
    engine = umbp.Engine()
    tier_bytes = pattern(4 * PAGE, 1)
    with engine.register(tier_bytes) as tier, engine.alloc_device(PAGE, label="kv-cache") as kv:
        assert kv.label == "kv-cache" and kv.kind == "device"
        past_end = umbp.Object(7, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 16)])
        error = engine.restore([past_end]).object(7).error
        assert isinstance(error, umbp.RejectedError)
        assert '"kv-cache"' in str(error) and "endpoint " not in str(error), str(error)


# -- duplicate tags have their own exception -------------------------------------------------


def test_two_objects_with_one_tag_raise_duplicate_tag_error_and_start_nothing():
    assert issubclass(umbp.DuplicateTagError, umbp.Error)
    engine = umbp.Engine()
    src = pattern(2 * PAGE, 2)
    dst = np.zeros(2 * PAGE, dtype=np.uint8)
    with engine.register(src) as tier, engine.register(dst) as kv:
        objects = [
            umbp.Object(5, tier, [k * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, k * PAGE)])
            for k in range(2)
        ]
        with pytest.raises(umbp.DuplicateTagError) as refused:
            engine.restore(objects)
        assert refused.value.tag == 5 and "tag 5" in str(refused.value)
        assert not dst.any(), "nothing of the batch moved"
        assert engine.metrics()["in_flight"]["batches"] == 0


# -- a cancelled batch reads CANCELLED -------------------------------------------------------


def test_a_batch_whose_only_shortfall_is_cancelled_objects_reads_cancelled():
    cancelled = umbp.CancelledError("cancelled")
    rejected = umbp.RejectedError("refused")
    report = umbp.Report._from(
        ("failed", [(1, "completed", None, None), (2, "cancelled", cancelled, None)])
    )
    assert report.aggregate is umbp.State.CANCELLED and not report.ok
    mixed = umbp.Report._from(
        ("failed", [(1, "rejected", rejected, None), (2, "cancelled", cancelled, None)])
    )
    assert mixed.aggregate is umbp.State.FAILED, "a rejected object is a failure"
    done = umbp.Report._from(("completed", [(1, "completed", None, None)]))
    assert done.aggregate is umbp.State.COMPLETED


def test_cancel_reports_cancelled_or_completed_never_failed():
    # However far the batch got before cancel(), its aggregate says what happened: every
    # object that did not complete was cancelled, so it reads CANCELLED (COMPLETED if all
    # finished first), never FAILED.
    engine = umbp.Engine()
    src = pattern(256 * PAGE, 6)
    with engine.register(src) as tier, engine.alloc_device(256 * PAGE) as kv:
        objects = [
            umbp.Object(i, tier, [i * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, i * PAGE, group=i)])
            for i in range(256)
        ]
        report = engine.start_restore(objects).cancel()
        states = {o.state for o in report.objects}
        if umbp.State.CANCELLED in states:
            assert report.aggregate is umbp.State.CANCELLED
        else:
            assert report.aggregate is umbp.State.COMPLETED
        assert report.aggregate == str(report.aggregate)  # still a string


# -- Engine.close() --------------------------------------------------------------------------


def test_close_waits_for_batches_in_flight_and_later_calls_raise_closed_error(tmp_path):
    engine = umbp.Engine()
    src = pattern(64 * PAGE, 3)
    tier = engine.register(src)
    kv = engine.alloc_device(64 * PAGE)
    pool = umbp.Pool(engine, umbp.PoolIndex(str(tmp_path / "pool.redb")), node=0)
    objects = [
        umbp.Object(i, tier, [i * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, i * PAGE)])
        for i in range(64)
    ]
    batch = engine.start_restore(objects)
    assert not engine.closed
    engine.close()
    assert engine.closed
    assert batch.done(), "close() returned only once the batch settled"
    assert batch.wait().aggregate is umbp.State.COMPLETED
    engine.close()  # idempotent
    for call in [
        lambda: engine.start_restore(objects),
        lambda: engine.restore(objects),
        lambda: engine.register(np.zeros(16, np.uint8)),
        lambda: engine.alloc_device(PAGE),
        lambda: engine.register_file(tmp_path / "f", 0, PAGE, create=True),
        lambda: engine.read(kv, 0, 16),
        lambda: engine.metrics(),
        lambda: umbp.Pool(engine, umbp.PoolIndex(str(tmp_path / "other.redb")), node=0),
        lambda: pool.put(0, [(bytes(16), tier, 0, PAGE)]),
        lambda: pool.get([(bytes(16), tier, 0, PAGE)]),
        lambda: pool.add_tier(0, tier, slot_size=PAGE, slot_count=4),
    ]:
        with pytest.raises(umbp.ClosedError, match="engine is closed"):
            call()
    assert pool.exists([bytes(16)]) == [False], "the index itself is still there"
    pool.close()
    tier.close()
    kv.close()


def test_close_from_many_threads_and_as_a_context_manager():
    with umbp.Engine() as engine:
        assert not engine.closed
    assert engine.closed
    engine = umbp.Engine()
    threads = [threading.Thread(target=engine.close) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.closed


# -- register_file(create=True), as documented -----------------------------------------------


def test_register_file_creates_a_missing_file_only_when_told(tmp_path):
    engine = umbp.Engine()
    path = tmp_path / "tier.bin"
    with pytest.raises(umbp.RegistrationError) as missing:
        engine.register_file(path, 0, 4 * PAGE)
    assert missing.value.errno == errno.ENOENT and not path.exists()
    with engine.register_file(path, 0, 4 * PAGE, create=True, extend=True) as f:
        assert path.exists() and os.path.getsize(path) == 4 * PAGE and f.length == 4 * PAGE
    # Creating needs a writable registration: a read-only one is refused, and creates nothing.
    with pytest.raises(umbp.RegistrationError, match="requires write"):
        engine.register_file(tmp_path / "ro.bin", 0, PAGE, create=True, writable=False)
    assert not (tmp_path / "ro.bin").exists()


# -- the embedded pool across a restart, from Python -----------------------------------------


SLOT = 4096
SLOTS = 16


def _node(tmp_path):
    """One process's pool: an embedded index and a durable SSD tier (the recipe of
    crates/umbp-py/README.md, "A pool kept across restarts")."""
    engine = umbp.Engine()  # checksums cover files: every get from the SSD tier is verified
    index = umbp.PoolIndex(str(tmp_path / "pool.redb"))
    path = str(tmp_path / "tier0.bin")
    ssd = engine.register_file(path, 0, SLOT * SLOTS, create=True, direct=False)
    report = index.reconcile([(0, 0, SLOT, SLOTS, path, 0)], "full")
    pool = umbp.Pool(engine, index, node=0)
    pool.add_tier(0, ssd, slot_size=SLOT, slot_count=SLOTS, durable=True)
    return engine, index, pool, ssd, report


def test_an_embedded_pool_restarts_with_its_blocks_and_reconciles_them(tmp_path):
    keys = [k.to_bytes(16, "big") for k in range(1, 5)]
    blocks = np.concatenate([np.full(SLOT, k, np.uint8) for k in range(1, 5)])

    engine, index, pool, ssd, report = _node(tmp_path)
    assert report.kept == 0 and report.dropped == []
    with engine.register(blocks) as src:
        results = pool.put(0, [(k, src, i * SLOT, SLOT) for i, k in enumerate(keys)])
        assert [r.status for r in results] == ["stored"] * 4
    pool.close()
    ssd.close()
    engine.close()
    del engine, index, pool, ssd
    gc.collect()  # the index's file is free for the next "process"

    # The restart: the same index and file; reconcile finds every block's bytes intact.
    engine, index, pool, ssd, report = _node(tmp_path)
    assert report.kept == 4 and report.dropped == [] and report.verified == 4
    out = np.zeros(4 * SLOT, np.uint8)
    with engine.register(out) as dst:
        got = pool.get([(k, dst, i * SLOT, SLOT) for i, k in enumerate(keys)])
    assert [r.status for r in got] == ["loaded"] * 4
    assert bytes(out) == bytes(blocks)
    victim = index.lookup(keys[2:3])[0]  # where the third block lives in the file
    assert victim is not None and victim.tier == 0
    pool.close()
    ssd.close()
    engine.close()
    del engine, index, pool, ssd
    gc.collect()

    # A crash that corrupted one block's bytes: reconcile drops that block alone.
    with open(tmp_path / "tier0.bin", "r+b") as f:
        f.seek(victim.slot * SLOT)
        f.write(bytes(SLOT))
    engine, index, pool, ssd, report = _node(tmp_path)
    assert report.kept == 3 and [reason for _, reason, _ in report.dropped] == ["checksum_mismatch"]
    assert report.dropped[0][0].key == keys[2]
    assert pool.exists(keys) == [True, True, False, True]
    pool.close()
    ssd.close()
    engine.close()
