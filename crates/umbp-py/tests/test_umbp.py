"""The umbp Python package: round trips through every engine with bytes checked, ranges that
cross pages, rejections that cost one object, typed errors, lifetimes, threads, and the
KV-connector adapter; typed errors with the caller's tag, states as an enum, and the Rust crates'
log events in Python's logging."""

import gc
import logging
import os
import threading
import time

import numpy as np
import pytest

import umbp

PAGE = 16 << 10


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97) >> 7).astype(np.uint8)


def object_bytes(tier, pages, offset, length):
    """The bytes `offset .. offset + length` of an object stored in `pages` of `tier`."""
    out = bytearray()
    for b in range(offset, offset + length):
        page = pages[b // PAGE]
        out.append(int(tier[page + b % PAGE]))
    return bytes(out)


@pytest.fixture
def engine():
    return umbp.Engine()


def test_host_to_device_and_back_through_the_simulated_gpu(engine):
    tier_bytes = pattern(32 * PAGE, 1)
    pages = np.array([5, 2, 30, 7], dtype=np.uint64) * PAGE
    with engine.register(tier_bytes) as tier, engine.alloc_device(8 * PAGE) as kv:
        # Two ranges that cross page boundaries, in two layer groups.
        ranges = [umbp.Range(100, PAGE + 50, kv, 0, group=0), umbp.Range(2 * PAGE + 7, PAGE, kv, 4 * PAGE, group=1)]
        obj = umbp.Object(tag=42, tier=tier, page_offsets=pages, page_size=PAGE, size=4 * PAGE, ranges=ranges)
        batch = engine.start_restore([obj])
        assert batch.wait_group(0, timeout=10)
        report = batch.wait(timeout=10)
        assert report.ok and report.object(42).state == "completed"
        assert engine.read(kv, 0, PAGE + 50) == object_bytes(tier_bytes, pages, 100, PAGE + 50)
        assert engine.read(kv, 4 * PAGE, PAGE) == object_bytes(tier_bytes, pages, 2 * PAGE + 7, PAGE)

        # Offload the device bytes into fresh host pages, whole object.
        out = np.zeros(8 * PAGE, dtype=np.uint8)
        with engine.register(out) as back:
            whole = [umbp.Range(0, 4 * PAGE, kv, 0)]
            back_pages = [3 * PAGE, 0, 5 * PAGE, PAGE]
            restored = umbp.Object(7, kv, [0, PAGE, 2 * PAGE, 3 * PAGE], PAGE, 4 * PAGE, [umbp.Range(0, 4 * PAGE, back, 0)])
            engine.restore([restored]).raise_for_errors()  # device -> host, contiguous
            offload = umbp.Object(8, back, back_pages, PAGE, 4 * PAGE, whole)
            engine.offload([offload]).raise_for_errors()  # device -> host pages
        device = engine.read(kv, 0, 4 * PAGE)
        for k, page in enumerate(back_pages):
            assert bytes(out[page:page + PAGE]) == device[k * PAGE:(k + 1) * PAGE]


def test_host_copies_and_ssd_round_trip(engine, tmp_path):
    src = pattern(16 * PAGE, 2)
    dst = np.zeros(16 * PAGE, dtype=np.uint8)
    path = tmp_path / "tier.bin"
    path.write_bytes(b"\0" * (16 * PAGE))
    with engine.register(src) as s, engine.register(dst) as d, engine.register_file(path) as f:
        assert f.kind == "file" and f.length == 16 * PAGE
        pages = [9 * PAGE, 1 * PAGE, 4 * PAGE]
        # Host -> SSD pages (offload), SSD -> host (restore), host -> host (restore).
        offload = umbp.Object(1, f, pages, PAGE, 3 * PAGE, [umbp.Range(0, 3 * PAGE, s, 0)])
        engine.offload([offload]).raise_for_errors()
        restore = umbp.Object(2, f, pages, PAGE, 3 * PAGE, [umbp.Range(0, 3 * PAGE, d, 0)])
        engine.restore([restore]).raise_for_errors()
        assert bytes(dst[:3 * PAGE]) == bytes(src[:3 * PAGE])
        on_disk = path.read_bytes()
        for k, page in enumerate(pages):
            assert on_disk[page:page + PAGE] == bytes(src[k * PAGE:(k + 1) * PAGE])
        host = umbp.Object(3, s, [2 * PAGE], PAGE, PAGE, [umbp.Range(10, 100, d, 8 * PAGE)])
        engine.restore([host]).raise_for_errors()
        assert bytes(dst[8 * PAGE:8 * PAGE + 100]) == bytes(src[2 * PAGE + 10:2 * PAGE + 110])
    m = engine.metrics()
    assert set(m) == {"engines", "in_flight", "checksums"}, m
    assert all(isinstance(k, tuple) and len(k) == 2 for k in m["engines"]), m
    assert m["engines"][("ssd", "host->file")]["bytes"] == 3 * PAGE
    assert m["in_flight"] == {"batches": 0, "bytes": 0}


def test_ssd_workers_pinned_to_a_cpu_restore_exactly_and_a_forbidden_cpu_is_an_error(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    engine = umbp.Engine(ssd_worker_cpus=[allowed[-1]])
    src = pattern(4 * PAGE, 5)
    path = tmp_path / "pinned.bin"
    path.write_bytes(bytes(src))
    dst = np.zeros(4 * PAGE, dtype=np.uint8)
    with engine.register(dst) as d, engine.register_file(path) as f:
        pages = [3 * PAGE, 0, 2 * PAGE]
        restore = umbp.Object(1, f, pages, PAGE, 3 * PAGE, [umbp.Range(0, 3 * PAGE, d, 0)])
        engine.restore([restore]).raise_for_errors()
        for k, page in enumerate(pages):
            assert bytes(dst[k * PAGE:(k + 1) * PAGE]) == bytes(src[page:page + PAGE])
    forbidden = next(cpu for cpu in range(1023, -1, -1) if cpu not in allowed)
    with pytest.raises(umbp.Error, match=f"CPU {forbidden}"):
        umbp.Engine(ssd_worker_cpus=[forbidden])


def test_an_invalid_range_rejects_only_its_object_with_the_reason(engine):
    tier_bytes = pattern(8 * PAGE, 3)
    with engine.register(tier_bytes) as tier, engine.alloc_device(4 * PAGE) as kv:
        good = umbp.Object(1, tier, [0, PAGE], PAGE, 2 * PAGE, [umbp.Range(0, 2 * PAGE, kv, 0)])
        past_end = umbp.Object(2, tier, [2 * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 4 * PAGE - 10)])
        past_object = umbp.Object(3, tier, [3 * PAGE], PAGE, PAGE, [umbp.Range(10, PAGE, kv, 2 * PAGE)])
        report = engine.restore([good, past_end, past_object])
        assert [o.state for o in report.objects] == ["completed", "rejected", "rejected"]
        assert isinstance(report.object(2).error, umbp.RejectedError)
        assert isinstance(report.object(2).error, umbp.Error)
        assert "outside endpoint" in report.object(2).error.reason
        # The message names no internal object number (object 2 sits at position 1).
        assert "object 1" not in str(report.object(2).error), str(report.object(2).error)
        assert "passes the end" in report.object(3).error.reason
        with pytest.raises(umbp.RejectedError):
            report.raise_for_errors()
        # The good object landed; the rejected ones wrote nothing.
        assert engine.read(kv, 0, 2 * PAGE) == bytes(tier_bytes[:2 * PAGE])
        assert engine.read(kv, 2 * PAGE, 2 * PAGE) == bytes(2 * PAGE)


def test_missing_and_read_only_files_are_typed_errors(engine, tmp_path):
    with pytest.raises(umbp.RegistrationError) as missing:
        engine.register_file(tmp_path / "absent.bin", 0, PAGE)
    assert missing.value.errno == 2
    # The engine's words, then the system's, once each.
    message = str(missing.value)
    assert "could not open" in message and message.count("No such file") == 1, message
    with pytest.raises(umbp.RegistrationError):
        engine.register_file(tmp_path / "absent.bin")
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\1" * (4 * PAGE))
    src = pattern(4 * PAGE, 4)
    with engine.register(src) as s, engine.register_file(path, writable=False) as ro:
        write = umbp.Object(1, ro, [0], PAGE, PAGE, [umbp.Range(0, PAGE, s, 0)])
        read = umbp.Object(2, ro, [PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, s, 2 * PAGE)])
        report = engine.offload([write])
        err = report.object(1).error
        assert isinstance(err, umbp.TransferError) and err.errno == 9  # EBADF
        engine.restore([read]).raise_for_errors()
        assert path.read_bytes() == b"\1" * (4 * PAGE), "the read-only file is unchanged"


def test_read_and_write_raise_the_objects_typed_error_and_refuse_bytes_past_the_end(engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\1" * (4 * PAGE))
    with engine.register_file(path, writable=False) as ro, engine.alloc_device(PAGE) as kv:
        with pytest.raises(umbp.TransferError) as failed:
            engine.write(ro, 0, b"x" * PAGE)
        assert failed.value.errno == 9 and failed.value.engine  # EBADF, from the SSD engine
        with pytest.raises(ValueError, match="outside the registration"):
            engine.read(kv, 0, 2 * PAGE)
        with pytest.raises(ValueError, match="outside the registration"):
            engine.read(kv, 1, (1 << 64) - 1)  # no allocation of 16 EiB is ever tried
        with pytest.raises(ValueError):
            engine.write(kv, PAGE - 1, b"ab")
    assert path.read_bytes() == b"\1" * (4 * PAGE)


def test_a_registration_works_only_with_the_engine_that_made_it(engine):
    other = umbp.Engine()
    ours, theirs = pattern(PAGE, 1), np.zeros(PAGE, dtype=np.uint8)
    with engine.register(ours) as tier, other.register(theirs) as foreign:
        # Both are the first user registration of their engine: the same id, other memory.
        assert tier.id == foreign.id
        obj = umbp.Object(0, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, foreign, 0)])
        with pytest.raises(ValueError, match="another engine"):
            engine.start_restore([obj])
        with pytest.raises(ValueError, match="another engine"):
            engine.read(foreign, 0, 8)
        # A raw id may name anything of the engine's but its bounce region.
        with pytest.raises(ValueError, match="bounce region"):
            engine.start_restore([umbp.Object(0, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, 0, 0)])])
    assert not theirs.any(), "nothing was written into the other engine's memory"


def test_the_same_memory_registered_twice_is_refused_as_on_a_gpu(engine):
    # Host memory is pinned for the device when registered; CUDA refuses to pin bytes twice,
    # and so does the simulated device: register an arena once and name its bytes by offset.
    arena = pattern(4 * PAGE, 3)
    with engine.register(arena) as whole:
        with pytest.raises(umbp.RegistrationError, match="already pinned") as refused:
            engine.register(arena[PAGE:2 * PAGE])
        # The simulated device says so in its own words, not as a CUDA runtime error.
        assert "simulated" in str(refused.value) and "712" not in str(refused.value)
        assert not whole.closed
    with engine.register(arena[PAGE:2 * PAGE]) as part:  # nothing pins those bytes now
        assert part.length == PAGE


def test_closing_a_registration_in_use_while_other_threads_look_at_it(engine, tmp_path):
    # One thread closes the tier while a batch still reads it (so the close waits); others
    # keep using the registration meanwhile and see it open, then closed, never an error.
    n = 1024
    tier_bytes = pattern(n * PAGE, 8)
    tier = engine.register(tier_bytes)
    kv = engine.alloc_device(n * PAGE)
    objects = [umbp.Object(i, tier, [(n - 1 - i) * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, i * PAGE, group=i)]) for i in range(n)]
    batch = engine.start_restore(objects)
    errors, closing = [], threading.Event()

    def look():
        try:
            while True:
                repr(tier), tier.id, tier.length
                if tier.closed:
                    return
                try:
                    engine.read(tier, 0, 8)
                except umbp.ClosedError:  # closed between the check and the read, or during it
                    assert tier.closed
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    lookers = [threading.Thread(target=look) for _ in range(4)]
    for t in lookers:
        t.start()
    tier.close()
    for t in lookers:
        t.join()
    assert not errors, errors
    assert batch.wait().ok
    kv.close()


def test_timeouts_without_limit_wait_and_nan_is_refused(engine):
    src = pattern(4 * PAGE, 2)
    with engine.register(src) as tier, engine.alloc_device(4 * PAGE) as kv:
        obj = umbp.Object(0, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 0)])
        batch = engine.start_restore([obj], timeout=1e300)
        assert batch.wait(float("inf")).ok
        assert batch.wait_group(0, 1e19) and batch.wait_group_enqueued(0, float("inf"))
        with pytest.raises(ValueError, match="NaN"):
            batch.wait(float("nan"))
        with pytest.raises(ValueError, match="NaN"):
            engine.start_restore([obj], timeout=float("nan"))
        # A negative timeout waits no time: None while in flight, the report once settled.
        assert batch.wait(-1.0).ok


def test_a_registration_outlives_del_of_its_array_while_a_batch_runs(engine):
    tier_bytes = pattern(64 * PAGE, 5)
    expected = bytes(tier_bytes)
    out = np.zeros(64 * PAGE, dtype=np.uint8)
    tier = engine.register(tier_bytes)
    dst = engine.register(out)
    objects = [umbp.Object(i, tier, [(63 - i) * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, dst, i * PAGE)]) for i in range(64)]
    batch = engine.start_restore(objects)
    del tier_bytes, tier  # the Python names go; the registration still holds the buffer
    gc.collect()
    report = batch.wait()
    assert report.ok
    for i in range(64):
        assert bytes(out[i * PAGE:(i + 1) * PAGE]) == expected[(63 - i) * PAGE:(64 - i) * PAGE]
    dst.close()
    assert dst.closed and "closed" in repr(dst)


def test_read_only_buffers_are_refused(engine):
    with pytest.raises(ValueError):
        engine.register(b"immutable bytes")
    with pytest.raises(TypeError):
        engine.register(12345)


def test_several_python_threads_share_one_engine(engine):
    errors = []

    def worker(seed):
        try:
            src = pattern(32 * PAGE, seed)
            with engine.register(src) as tier, engine.alloc_device(32 * PAGE) as kv:
                for round in range(5):
                    pages = [((k * 7 + seed + round) % 32) * PAGE for k in range(8)]
                    obj = umbp.Object(round, tier, pages, PAGE, 8 * PAGE, [umbp.Range(0, 8 * PAGE, kv, 0)])
                    engine.restore([obj]).raise_for_errors()
                    got = engine.read(kv, 0, 8 * PAGE)
                    want = b"".join(bytes(src[p:p + PAGE]) for p in pages)
                    assert got == want
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_cancel_and_timeouts(engine):
    src = pattern(256 * PAGE, 6)
    with engine.register(src) as tier, engine.alloc_device(256 * PAGE) as kv:
        objects = [umbp.Object(i, tier, [i * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, i * PAGE, group=i)]) for i in range(256)]
        batch = engine.start_restore(objects)
        report = batch.cancel()
        assert batch.done()
        assert {o.state for o in report.objects} <= {"completed", "cancelled"}
        for o in report.objects:
            if o.state == "cancelled":
                assert isinstance(o.error, umbp.CancelledError)
        assert engine.start_restore(objects[:1]).wait(timeout=10).ok


def test_a_restore_on_a_stream_is_ready_per_group_with_an_event_each(engine):
    # The simulated device takes any handle as a stream and finishes work as it is queued; on
    # a GPU the same calls queue on the caller's CUDA stream (a torch.cuda.Stream works too).
    tier_bytes = pattern(16 * PAGE, 4)
    pages = np.array([9, 3, 12, 0], dtype=np.uint64) * PAGE
    with engine.register(tier_bytes) as tier, engine.alloc_device(4 * PAGE) as kv:
        ranges = [umbp.Range(k * PAGE, PAGE, kv, k * PAGE, group=k) for k in range(4)]
        obj = umbp.Object(tag=5, tier=tier, page_offsets=pages, page_size=PAGE, size=4 * PAGE, ranges=ranges)
        batch = engine.start_restore([obj], stream=0x1234, device=0)
        events = []
        for group in range(4):
            assert batch.wait_group_enqueued(group, timeout=10)
            event = batch.group_event(group, timeout=10)
            assert isinstance(event, int) and event != 0
            events.append(event)
        assert len(set(events)) == 4, "one event per group"
        assert batch.wait(timeout=10).ok
        for k, page in enumerate(pages):
            assert engine.read(kv, k * PAGE, PAGE) == bytes(tier_bytes[int(page):int(page) + PAGE])
        plain = engine.start_restore([obj])
        assert plain.wait(timeout=10).ok
        with pytest.raises(umbp.Error, match="without a stream"):
            plain.group_event(0)
        with pytest.raises(TypeError):
            engine.start_restore([obj], stream="not a stream")


def test_the_kv_connector_loads_on_the_servers_stream(engine, tmp_path):
    from umbp.connector import KVConnector

    layers, blocks, block_bytes = 12, 4, 4096
    buffers = [engine.alloc_device(blocks * block_bytes) for _ in range(layers)]
    kv = KVConnector(engine, buffers, block_bytes, dram_slots=4, ssd_path=str(tmp_path / "kv.bin"), ssd_slots=4, layers_per_group=4)
    data = {k: bytes(pattern(layers * block_bytes, 50 + i)) for i, k in enumerate(("a", "b"))}
    kv.store("a", "dram", data["a"])
    kv.store("b", "ssd", data["b"])
    kv.start_load([("a", 1), ("b", 3)], stream=77)
    for layer in range(layers):
        assert kv.wait_for_layer(layer, timeout=30) == []
    # On a stream a layer is ready once its group is queued there: the load settles (and
    # finished() reports it) only after the stream ran it, which may be later.
    assert kv.wait_for_load(timeout=60) == []
    loaded, _ = kv.finished()
    assert loaded == {"a", "b"}
    for layer in (0, 5, 11):
        for key, block in (("a", 1), ("b", 3)):
            got = engine.read(buffers[layer], block * block_bytes, block_bytes)
            assert got == data[key][layer * block_bytes:(layer + 1) * block_bytes]
    kv.close()
    for b in buffers:
        b.close()


def test_the_kv_connector_loads_61_layers_in_groups_in_order(engine, tmp_path):
    from umbp.connector import KVConnector

    layers, blocks, block_bytes = 61, 8, 4096
    buffers = [engine.alloc_device(blocks * block_bytes) for _ in range(layers)]
    kv = KVConnector(engine, buffers, block_bytes, dram_slots=8, ssd_path=str(tmp_path / "kv.bin"), ssd_slots=8, layers_per_group=8)
    cached = {}
    for i in range(6):
        data = bytes(pattern(layers * block_bytes, 100 + i))
        kv.store(f"block{i}", "dram" if i % 2 == 0 else "ssd", data)
        cached[f"block{i}"] = data
    requests = [(f"block{i}", (i * 3) % blocks) for i in range(6)]
    kv.start_load(requests)
    order = []
    for layer in range(layers):
        failed = kv.wait_for_layer(layer, timeout=30)
        assert failed == []
        order.append(kv.group_of(layer))
        # The layer's bytes are in place once its group landed.
        if layer % 20 == 0:
            for key, block in requests:
                got = engine.read(buffers[layer], block * block_bytes, block_bytes)
                assert got == cached[key][layer * block_bytes:(layer + 1) * block_bytes]
    assert order == sorted(order)
    assert kv.wait_for_load(timeout=60) == []
    loaded, _ = kv.finished()
    assert loaded == set(cached)

    # Save a new block layer by layer into DRAM, then load it back elsewhere.
    fresh = bytes(pattern(layers * block_bytes, 7))
    for layer in range(layers):
        engine.write(buffers[layer], 7 * block_bytes, fresh[layer * block_bytes:(layer + 1) * block_bytes])
        kv.save_layer(layer, [("new", 7)])
    assert kv.wait_for_save() == []
    _, saved = kv.finished()
    assert saved == {"new"}
    kv.start_load([("new", 0)])
    kv.wait_for_layer(layers - 1, timeout=30)
    for layer in (0, 30, 60):
        assert engine.read(buffers[layer], 0, block_bytes) == fresh[layer * block_bytes:(layer + 1) * block_bytes]
    kv.close()
    for b in buffers:
        b.close()


def test_a_failed_or_partial_save_leaves_what_was_cached_loadable_and_frees_its_slot(engine, tmp_path):
    from umbp.connector import KVConnector

    layers, blocks, block_bytes = 4, 2, 4096
    buffers = [engine.alloc_device(blocks * block_bytes) for _ in range(layers)]
    kv = KVConnector(engine, buffers, block_bytes, dram_slots=3, ssd_path=str(tmp_path / "kv.bin"), ssd_slots=1, layers_per_group=2)
    cached = bytes(pattern(layers * block_bytes, 11))
    kv.store("k", "dram", cached)

    # A new copy of "k" whose layer 1 is refused (block 9 lies past the layer's buffer).
    for layer in range(layers):
        kv.save_layer(layer, [("k", 9 if layer == 1 else 0)])
    # A key saved in one layer only.
    kv.save_layer(0, [("partial", 1)])
    assert kv.wait_for_save() == ["k", "partial"]
    assert kv.finished() == (set(), set())

    # "k" still loads its cached bytes, untouched by the save's layers that did land.
    kv.start_load([("k", 1)])
    assert kv.wait_for_layer(layers - 1, timeout=30) == []
    assert kv.wait_for_load(timeout=60) == []
    assert kv.finished()[0] == {"k"}
    for layer in range(layers):
        got = engine.read(buffers[layer], block_bytes, block_bytes)
        assert got == cached[layer * block_bytes:(layer + 1) * block_bytes], layer
    with pytest.raises(KeyError):
        kv.start_load([("partial", 0)])

    # Both new slots went back: two more keys fit beside "k" in three DRAM slots, and saving
    # one of them again frees its first slot once the new copy is whole.
    for key in ("x", "y"):
        kv.store(key, "dram", cached)
    for layer in range(layers):
        kv.save_layer(layer, [("x", 0)], tier="ssd")
    assert kv.wait_for_save() == []
    assert kv.index["x"][0] is kv.ssd
    kv.store("z", "dram", cached)
    kv.close()
    for b in buffers:
        b.close()


def test_a_slot_replaced_while_a_load_may_read_it_is_reused_only_after_the_load(engine, tmp_path):
    from umbp.connector import KVConnector

    layers, block_bytes = 2, 4096
    buffers = [engine.alloc_device(2 * block_bytes) for _ in range(layers)]
    kv = KVConnector(engine, buffers, block_bytes, dram_slots=2, ssd_path=str(tmp_path / "kv.bin"), ssd_slots=1)
    old, new = bytes(pattern(layers * block_bytes, 1)), bytes(pattern(layers * block_bytes, 2))
    kv.store("k", "dram", old)
    kv.start_load([("k", 0)])  # reads the old slot until `finished` sees it over
    for layer in range(layers):
        engine.write(buffers[layer], block_bytes, new[layer * block_bytes:(layer + 1) * block_bytes])
        kv.save_layer(layer, [("k", 1)])
    assert kv.wait_for_save() == []
    # Both DRAM slots are taken: the new copy's, and the old one the load may still read.
    with pytest.raises(umbp.Error, match="no free dram slot"):
        kv.store("other", "dram", old)
    assert kv.wait_for_load(timeout=60) == []
    loaded, saved = kv.finished()
    assert loaded == {"k"} and saved == {"k"}
    assert engine.read(buffers[1], 0, block_bytes) == old[block_bytes:]
    kv.store("other", "dram", old)  # the old slot is free now
    kv.start_load([("k", 0)])
    kv.wait_for_layer(layers - 1, timeout=30)
    assert engine.read(buffers[1], 0, block_bytes) == new[block_bytes:]
    kv.close()
    for b in buffers:
        b.close()


def test_torch_tensors_register_when_torch_is_installed(engine):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = torch.arange(4 * PAGE, dtype=torch.uint8)
    out = torch.zeros(4 * PAGE, dtype=torch.uint8)
    with engine.register(t) as src, engine.register(out) as dst:
        obj = umbp.Object(1, src, [2 * PAGE, 0], PAGE, 2 * PAGE, [umbp.Range(0, 2 * PAGE, dst, 0)])
        engine.restore([obj]).raise_for_errors()
    assert torch.equal(out[:PAGE], t[2 * PAGE:3 * PAGE]) and torch.equal(out[PAGE:2 * PAGE], t[:PAGE])
    with pytest.raises(ValueError, match="not host memory"):
        engine.register(torch.empty(PAGE, dtype=torch.uint8, device="meta"))
    if umbp.CUDA and torch.cuda.is_available():
        gpu = umbp.Engine("cuda")
        dev = torch.zeros(2 * PAGE, dtype=torch.uint8, device="cuda")
        with gpu.register(t) as src, gpu.register(dev) as kv:
            obj = umbp.Object(1, src, [2 * PAGE, 0], PAGE, 2 * PAGE, [umbp.Range(0, 2 * PAGE, kv, 0)])
            gpu.restore([obj]).raise_for_errors()
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu()[:PAGE], t[2 * PAGE:3 * PAGE])


#: The shared secret the remote tests' servers and engines authenticate each other with.
SECRET = b"umbp python tests: 32 bytes long"


def _remote_engine():
    """An engine with the remote tier over TCP, or a skip with the reason when UCX is missing."""
    try:
        return umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET)
    except umbp.Error as e:
        if os.environ.get("UMBP_REQUIRE_UCX") == "1":
            raise
        pytest.skip(f"no remote tier here: {e}")


def test_a_memory_node_serves_restores_and_offloads_and_its_loss_costs_only_its_objects():
    engine = _remote_engine()
    arena = pattern(64 * PAGE, 5)
    dram_bytes = pattern(64 * PAGE, 9)
    server = umbp.Server({"arena": arena, "ro": (pattern(4 * PAGE, 3), False)}, transports="tcp", secret=SECRET)
    peer = engine.connect(server.address)
    assert [r.name for r in peer.regions] == ["arena", "ro"] and not peer.region("ro").writable
    with engine.register(dram_bytes) as dram, engine.register_remote(peer.region("arena")) as remote, \
            engine.alloc_device(16 * PAGE) as kv:
        assert remote.kind == "remote" and remote.length == 64 * PAGE
        # Object 1 from the node's memory, object 2 from local DRAM, both into the (simulated)
        # device in one batch.
        far, near = [40, 3, 17, 60], [8, 1, 30, 2]
        objects = [
            umbp.Object(1, remote, [p * PAGE for p in far], PAGE, 4 * PAGE, [umbp.Range(0, 4 * PAGE, kv, 0)]),
            umbp.Object(2, dram, [p * PAGE for p in near], PAGE, 4 * PAGE, [umbp.Range(0, 4 * PAGE, kv, 8 * PAGE)]),
        ]
        engine.restore(objects).raise_for_errors()
        assert engine.read(kv, 0, 4 * PAGE) == object_bytes(arena, [p * PAGE for p in far], 0, 4 * PAGE)
        assert engine.read(kv, 8 * PAGE, 4 * PAGE) == object_bytes(dram_bytes, [p * PAGE for p in near], 0, 4 * PAGE)

        # Offload the device's first object to other pages of the node.
        back = [10, 50, 11, 33]
        engine.offload([umbp.Object(3, remote, [p * PAGE for p in back], PAGE, 4 * PAGE,
                                    [umbp.Range(0, 4 * PAGE, kv, 0)])]).raise_for_errors()
        assert engine.read(remote, 50 * PAGE, PAGE) == object_bytes(arena, [p * PAGE for p in far], PAGE, PAGE)

        # Past the export: refused at registration.
        with pytest.raises(umbp.RegistrationError):
            engine.register_remote(peer.region("arena"), 60 * PAGE, 8 * PAGE)

        # The node goes away: its objects fail, local ones still complete.
        server.close()
        report = engine.restore(objects)
        assert report.object(2).ok
        failed = report.object(1)
        assert not failed.ok and isinstance(failed.error, umbp.TransferError)
        assert "peer" in failed.error.cause
        # The engine tells a node that went away (so a caller connects anew once it is back),
        # once it noticed the node's control connection end.
        deadline = time.monotonic() + 30
        while engine.peer_alive(peer):
            assert time.monotonic() < deadline, "a node that went away still reads alive"
            time.sleep(0.01)


def _admitted(server, n):
    """The server's client count once it reaches `n`: the server counts a connection when its
    side of the handshake ends, which may come just after the engine's `connect` returned. It
    waits without a time limit that matters (a loaded machine only waits longer); after a
    minute it gives up and returns the count, for the caller's assert to report."""
    deadline = time.monotonic() + 60
    while server.clients < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return server.clients


def test_remote_lanes_sets_the_connections_to_each_node():
    with pytest.raises(ValueError, match="remote_lanes"):
        umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET, remote_lanes=0)
    _remote_engine()  # skips where there is no remote tier
    one = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET, remote_lanes=1)
    arena = pattern(8 * PAGE, 4)
    with umbp.Server({"arena": arena}, transports="tcp", secret=SECRET) as server:
        one.connect(server.address)
        with_one = _admitted(server, 1)
        three = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET, remote_lanes=3)
        peer = three.connect(server.address)
        # Two connections more than an engine with one lane.
        both = _admitted(server, 2 * with_one + 2)
        assert both - with_one == with_one + 2, (with_one, both)
        out = np.zeros(4 * PAGE, dtype=np.uint8)
        with three.register_remote(peer.region("arena")) as remote, three.register(out) as dst:
            pages = [6, 1, 3, 0]
            obj = umbp.Object(1, remote, [p * PAGE for p in pages], PAGE, 4 * PAGE, [umbp.Range(0, 4 * PAGE, dst, 0)])
            three.restore([obj]).raise_for_errors()
            assert bytes(out) == object_bytes(arena, [p * PAGE for p in pages], 0, 4 * PAGE)


def test_remote_congestion_reaches_the_engine_and_the_server():
    _remote_engine()  # skips where there is no remote tier
    remote = dict(remote=True, remote_transports="tcp", remote_secret=SECRET)
    arena = pattern(4 * PAGE, 8)
    # A name that cannot be an algorithm's: ValueError naming the argument, before anything
    # starts; one the kernel does not have: umbp.Error when the engine or server starts.
    with pytest.raises(ValueError, match="remote_congestion"):
        umbp.Engine(remote_congestion="cubic; reboot", **remote)
    with pytest.raises(ValueError, match="congestion"):
        umbp.Server({"arena": arena}, transports="tcp", secret=SECRET, congestion="")
    with pytest.raises(umbp.Error, match="congestion.*no-such-cc"):
        umbp.Engine(remote_congestion="no-such-cc", **remote)
    with pytest.raises(umbp.Error, match="congestion.*no-such-cc"):
        umbp.Server({"arena": arena}, transports="tcp", secret=SECRET, congestion="no-such-cc")
    # reno, which every Linux kernel has and lets any process pick, on both sides; the
    # system's on the engine's.
    for choice in ("reno", "system", "auto"):
        engine = umbp.Engine(remote_congestion=choice, **remote)
        with umbp.Server({"arena": arena}, transports="tcp", secret=SECRET, congestion="reno") as server:
            peer = engine.connect(server.address)
            with engine.register_remote(peer.region("arena")) as src:
                assert engine.read(src, PAGE, 64) == bytes(arena[PAGE:PAGE + 64]), choice
        engine.close()


DROP_WHILE_LOGGING = """
import logging, threading, time
import numpy as np
import umbp
SECRET = %r
inside, go = threading.Event(), threading.Event()
class Gate(logging.Handler):
    # Holds the engine's thread inside Python's logging (with the GIL given up while it waits),
    # then hands it back to the GIL while the main thread is dropping the engine.
    def emit(self, record):
        if "declared dead" in record.getMessage():
            inside.set()
            go.wait()
            time.sleep(0.3)
logging.getLogger("umbp_remote").addHandler(Gate())
engine = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET)
with umbp.Server({"arena": np.zeros(4096, dtype=np.uint8)}, transports="tcp", secret=SECRET) as server:
    engine.connect(server.address)
assert inside.wait(120), "the engine never logged its peer's end"
go.set()
del engine
print("dropped")
"""


def test_dropping_an_engine_while_its_threads_log_does_not_deadlock():
    # A remote engine's progress thread logs (through Python's logging, so with the GIL) when a
    # peer goes; an engine dropped meanwhile joins that thread, which must not happen with the
    # GIL held. It did, and hung the suite now and then; here the thread is held in the log
    # call until the drop begins, so the old code hangs every time. In a child process so a
    # hang is a failure, not a stuck suite.
    import subprocess
    import sys

    _remote_engine()  # skips where there is no remote tier
    try:
        run = subprocess.run([sys.executable, "-c", DROP_WHILE_LOGGING % SECRET], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"dropping the engine hung (the child ran {e.timeout} s): {e.stderr}")
    assert run.returncode == 0 and run.stdout.strip() == "dropped", (run.returncode, run.stdout, run.stderr)


def test_a_disconnected_node_fails_its_objects_at_once():
    engine = _remote_engine()
    with umbp.Server({"arena": pattern(8 * PAGE, 2)}, transports="tcp", secret=SECRET) as server:
        peer = engine.connect(server.address)
        out = np.zeros(PAGE, dtype=np.uint8)
        with engine.register_remote(peer.region("arena")) as remote, engine.register(out) as dst:
            obj = umbp.Object(1, remote, [3 * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, dst, 0)])
            engine.restore([obj]).raise_for_errors()
            assert bytes(out) == bytes(pattern(8 * PAGE, 2)[3 * PAGE:4 * PAGE])
            assert engine.peer_alive(peer)
            engine.disconnect(peer)
            assert not engine.peer_alive(peer)
            report = engine.restore([obj])
            assert not report.ok and "disconnected" in report.object(1).error.cause


def test_a_memory_node_serves_only_engines_that_prove_its_secret():
    engine = _remote_engine()
    stranger = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=b"another secret of 32 bytes here!")
    arena = pattern(4 * PAGE, 6)
    with umbp.Server({"arena": arena}, transports="tcp", secret=SECRET) as server:
        assert engine.connect(server.address).region("arena").length == 4 * PAGE
        # The words say what is wrong, whichever side holds the other secret.
        with pytest.raises(umbp.Error, match=r"authentication failed \(wrong or missing secret on this side or the server's\)"):
            stranger.connect(server.address)
    if os.environ.get("UMBP_UCX_SECRET") is None:
        # No secret anywhere: refused, unless running without authentication is asked for; the
        # error names the arguments and the variable that give one.
        with pytest.raises(umbp.Error, match=r"secret.*remote_secret=.*UMBP_UCX_SECRET"):
            umbp.Engine(remote=True, remote_transports="tcp").connect("127.0.0.1:9")  # refused before connecting
        with pytest.raises(umbp.Error, match=r"Server\(secret=\)"):
            umbp.Server({"arena": arena}, transports="tcp")
        with umbp.Server({"arena": arena}, transports="tcp", insecure_no_auth=True) as open_node:
            insecure = umbp.Engine(remote=True, remote_transports="tcp", remote_insecure_no_auth=True)
            peer = insecure.connect(open_node.address)
            with insecure.register_remote(peer.region("arena")) as remote:
                assert insecure.read(remote, PAGE, 64) == bytes(arena[PAGE:PAGE + 64])


# -- typed errors, states, the connector's unknown keys ---------------------------------------


def test_an_objects_error_carries_the_callers_tag_and_a_typed_kind(engine, tmp_path):
    tier_bytes = pattern(8 * PAGE, 3)
    with engine.register(tier_bytes) as tier, engine.alloc_device(4 * PAGE) as kv:
        good = umbp.Object(1001, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 0)])
        past_end = umbp.Object(77, tier, [2 * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 4 * PAGE - 10)])
        report = engine.restore([good, past_end])
        err = report.object(77).error
        # The caller's tag (77), not the object's position in the batch (1).
        assert isinstance(err, umbp.RejectedError) and err.tag == 77
        assert err.kind is umbp.RejectKind.OUT_OF_BOUNDS and err.kind == "out_of_bounds"
        with pytest.raises(umbp.RejectedError) as raised:
            report.raise_for_errors()
        assert raised.value.tag == 77
    # An I/O failure: the errno, its kind, and the OSError as the cause.
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\1" * (2 * PAGE))
    src = pattern(2 * PAGE, 4)
    with engine.register(src) as s, engine.register_file(path, writable=False) as ro:
        report = engine.offload([umbp.Object(5, ro, [0], PAGE, PAGE, [umbp.Range(0, PAGE, s, 0)])])
        err = report.object(5).error
        assert isinstance(err, umbp.TransferError) and err.tag == 5
        assert err.kind is umbp.FailureKind.IO and err.errno == 9
        assert isinstance(err.__cause__, OSError) and err.__cause__.errno == 9
        # A read or write of one registration has no object tag.
        with pytest.raises(umbp.TransferError) as failed:
            engine.write(ro, 0, b"x" * PAGE)
        assert failed.value.tag is None and failed.value.kind is umbp.FailureKind.IO
    # Errors made without an object have the attribute too, as None.
    with pytest.raises(umbp.RegistrationError) as missing:
        engine.register_file(tmp_path / "absent.bin", 0, PAGE)
    assert missing.value.tag is None


def test_states_are_one_enum_that_still_compares_equal_to_the_old_strings(engine):
    tier_bytes = pattern(64 * PAGE, 8)
    with engine.register(tier_bytes) as tier, engine.alloc_device(64 * PAGE) as kv:
        objects = [umbp.Object(t, tier, [t * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, kv, t * PAGE)]) for t in range(64)]
        batch = engine.start_restore(objects)
        now = batch.report()
        assert now.aggregate in (umbp.State.IN_FLIGHT, umbp.State.COMPLETED)
        assert all(isinstance(o.state, umbp.State) for o in now.objects)
        assert isinstance(batch.state(3), umbp.State) and batch.state(9999) is None
        report = batch.wait()
        assert report.aggregate is umbp.State.COMPLETED and report.aggregate == "completed"
        assert all(o.state is umbp.State.COMPLETED and o.state == "completed" for o in report.objects)
        assert batch.state(3) is umbp.State.COMPLETED
    # One spelling for "in flight", the objects' and the aggregate's; the aggregate's old one
    # still converts.
    assert umbp.State.IN_FLIGHT == "in_flight" and umbp.State("inflight") is umbp.State.IN_FLIGHT
    assert f"{umbp.State.FAILED}" == "failed" and str(umbp.State.CANCELLED) == "cancelled"
    assert not umbp.State.IN_FLIGHT.settled and umbp.State.REJECTED.settled


def test_the_kv_connector_refuses_an_unknown_key_with_an_umbp_error_and_stays_usable(engine, tmp_path):
    from umbp.connector import KVConnector

    layers, blocks, block_bytes = 4, 2, 4096
    buffers = [engine.alloc_device(blocks * block_bytes) for _ in range(layers)]
    kv = KVConnector(engine, buffers, block_bytes, dram_slots=2, ssd_path=str(tmp_path / "kv.bin"), ssd_slots=2)
    data = bytes(pattern(layers * block_bytes, 21))
    kv.store("known", "dram", data)
    with pytest.raises(umbp.UnknownKeyError) as unknown:
        kv.start_load([("known", 0), ("never stored", 1)])
    assert isinstance(unknown.value, umbp.Error) and isinstance(unknown.value, KeyError)
    assert unknown.value.key == "never stored" and "never stored" in str(unknown.value)
    # Nothing started: the next load runs.
    kv.start_load([("known", 1)])
    assert kv.wait_for_load(timeout=60) == []
    assert kv.finished()[0] == {"known"}
    assert engine.read(buffers[2], block_bytes, block_bytes) == data[2 * block_bytes:3 * block_bytes]
    kv.close()
    for b in buffers:
        b.close()


# -- logs ---------------------------------------------------------------------------------------


def test_rust_debug_events_reach_python_logging_under_the_crates_names(engine, caplog):
    caplog.set_level(logging.DEBUG)
    umbp.reset_log_cache()  # the levels were cached at WARNING by earlier tests
    try:
        tier_bytes = pattern(4 * PAGE, 1)
        with engine.register(tier_bytes) as tier, engine.alloc_device(PAGE) as kv:
            bad = umbp.Object(31, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 10)])
            assert not engine.restore([bad]).ok
        rejected = [r for r in caplog.records if "object rejected" in r.getMessage()]
        assert rejected, [(r.name, r.getMessage()) for r in caplog.records]
        assert all(r.levelno == logging.DEBUG and r.name.startswith("umbp_") for r in rejected)
    finally:
        caplog.set_level(logging.WARNING)
        umbp.reset_log_cache()


def test_a_warning_emitted_in_rust_is_captured_through_logging(caplog):
    """The remote engine warns (tracing::warn! in umbp-remote, on its progress thread, not a
    Python one) when a memory node goes away; the warning reaches `logging` with no set-up
    beyond the default."""
    engine = _remote_engine()  # skips without UCX
    caplog.set_level(logging.WARNING)
    server = umbp.Server({"arena": pattern(4 * PAGE, 6)}, transports="tcp", secret=SECRET)
    peer = engine.connect(server.address)
    out = np.zeros(PAGE, dtype=np.uint8)
    with engine.register_remote(peer.region("arena")) as remote, engine.register(out) as dst:
        obj = umbp.Object(1, remote, [PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, dst, 0)])
        engine.restore([obj]).raise_for_errors()
        assert not [r for r in caplog.records if r.name.startswith("umbp_")]
        server.close()
        assert not engine.restore([obj]).ok
        # The progress thread logs the loss; wait for it (not a time budget: it must come).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dead = [r for r in caplog.records if "peer declared dead" in r.getMessage()]
            if dead:
                break
            time.sleep(0.05)
    assert dead, [(r.name, r.getMessage()) for r in caplog.records]
    assert dead[0].levelno == logging.WARNING and dead[0].name == "umbp_remote.progress"
    assert f"peer={peer.id}" in dead[0].getMessage()  # the event's fields come with it
    assert dead[0].threadName != threading.current_thread().name
