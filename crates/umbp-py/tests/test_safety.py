"""What Python cannot be allowed to break: a registration closed from many threads at once
ends before any close returns; only buffers of plain numbers and bytes register; sizes too big
for the machine raise instead of aborting; and the KV connector never publishes bytes it did
not write."""

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import umbp
from umbp.connector import KVConnector

PAGE = 16 << 10
POISON = 0xA5


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97) >> 7).astype(np.uint8)


@pytest.fixture
def engine():
    return umbp.Engine()


def fifo_or_skip(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this system")
    path = tmp_path / "stuck.fifo"
    os.mkfifo(path)
    return path


def test_sixteen_closes_under_a_running_batch_all_return_only_after_it_ended(engine, tmp_path):
    # A restore from a FIFO waits for bytes that only arrive when the test writes them, so the
    # batch is writing the destination for as long as the test wants. Sixteen threads close
    # the destination at once meanwhile: none may return before the batch is over, and once
    # they have returned nothing writes the buffer any more (poisoned after they returned, it
    # stays poisoned).
    fifo = fifo_or_skip(tmp_path)
    source = engine.register_file(fifo, 0, 4096, direct=False)  # read-write: no wait to open
    buffer = np.full(4096, POISON, dtype=np.uint8)
    destination = engine.register(buffer)
    obj = umbp.Object(1, source, [0], 4096, 4096, [umbp.Range(0, 4096, destination, 0)])
    batch = engine.start_restore([obj])

    closers = 16
    ready = threading.Barrier(closers + 1)
    returned = []
    errors = []

    def close():
        try:
            ready.wait()
            destination.close()
            returned.append(batch.done())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=close) for _ in range(closers)]
    for t in threads:
        t.start()
    payload = bytes(pattern(4096, 3))
    try:
        ready.wait()
        # However long the closers take, the batch cannot end before the FIFO has bytes: a
        # close that returns now returned under a running batch.
        time.sleep(0.3)
        assert returned == [] and not batch.done(), "a close returned while the batch still ran"
        assert destination.closed
    finally:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, payload)  # 4096 bytes: one atomic pipe write
        finally:
            os.close(fd)
        for t in threads:
            t.join()
    assert not errors, errors
    assert returned == [True] * closers, "every close returned after the batch settled"
    assert bytes(buffer) == payload, "the restore landed before the closes returned"

    buffer[:] = POISON
    report = batch.wait()
    assert report.ok, report
    assert (buffer == POISON).all(), "nothing wrote the buffer after close returned"
    source.close()


def test_closes_racing_a_long_host_restore_never_return_before_it_and_del_is_safe(engine):
    # The same without a FIFO: a long restore of many objects into one destination, which 16
    # threads close while it runs; then the array goes away. Closing must wait for every
    # object, so the report is whole, and after the closes nothing writes the (poisoned) array.
    n = 512
    tier_bytes = pattern(n * PAGE, 4)
    out = np.full(n * PAGE, POISON, dtype=np.uint8)
    with engine.register(tier_bytes) as tier:
        destination = engine.register(out)
        objects = [umbp.Object(i, tier, [(n - 1 - i) * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, destination, i * PAGE)]) for i in range(n)]
        batch = engine.start_restore(objects)
        done_at_return = []
        lock = threading.Lock()

        def close():
            destination.close()
            with lock:
                if not done_at_return:  # the first close back poisons the array
                    out[:] = POISON
                done_at_return.append(batch.done())

        threads = [threading.Thread(target=close) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert done_at_return == [True] * 16
        report = batch.wait()
        assert report.ok
        assert (out == POISON).all(), "nothing wrote the array after a close returned"
        del out, destination
        gc.collect()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.array([object(), 1, "x"], dtype=object),
        lambda: np.zeros(4, dtype=[("a", "<i4"), ("b", "O")]),
        lambda: np.zeros(2, dtype=np.dtype([("outer", [("inner", "O")])])),
        lambda: np.zeros(3, dtype="U3"),
        lambda: (ctypes.c_void_p * 3)(),
        lambda: (ctypes.c_char_p * 3)(),
    ],
    ids=["object", "structured-object", "nested-object", "unicode", "pointers", "char-pointers"],
)
def test_buffers_of_objects_pointers_or_text_are_refused(engine, make):
    buffer = make()
    with pytest.raises(TypeError, match="plain numbers and bytes"):
        engine.register(buffer)
    with pytest.raises(TypeError, match="plain numbers and bytes"):
        umbp.Server({"arena": buffer})


def test_an_object_array_cannot_be_restored_into(engine):
    # What used to crash: restoring bytes into an object array, then printing an element.
    tier_bytes = pattern(PAGE, 9)
    objects = np.array([object() for _ in range(PAGE // 8)], dtype=object)
    with engine.register(tier_bytes) as tier:
        with pytest.raises(TypeError):
            engine.register(objects)
    assert all(type(o) is object for o in objects)
    repr(objects[0])


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(4, dtype=[("a", "<i4"), ("b", "f8", (2, 3))]),
        lambda: np.zeros(3, dtype=np.dtype([("a", "<i4"), ("b", "u1")], align=True)),
        lambda: np.zeros(3, dtype="c16"),
        lambda: np.zeros(3, dtype="f2"),
        lambda: np.zeros(3, dtype=bool),
        lambda: np.zeros(3, dtype=">i8"),
        lambda: np.zeros(3, dtype="V8"),
        lambda: np.zeros(3, dtype="S4"),
        lambda: np.zeros((2, 3), dtype=np.longdouble),
        lambda: bytearray(8),
        lambda: (ctypes.c_int * 3)(),
    ],
)
def test_buffers_of_numbers_and_bytes_register(engine, make):
    buffer = make()
    with engine.register(buffer) as r:
        assert r.length == memoryview(buffer).nbytes


def run_isolated(script, tmp_path):
    """Runs `script` in a fresh interpreter (an abort there cannot take the test run down)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout.split()


def test_sizes_too_big_for_the_machine_raise_instead_of_aborting(tmp_path):
    out = run_isolated(
        """
        import umbp
        def outcome(f):
            try:
                f()
                return "ok"
            except (MemoryError, ValueError, umbp.Error) as e:
                return type(e).__name__
        print(outcome(lambda: umbp.Engine(bounce_bytes=1 << 50)))
        print(outcome(lambda: umbp.Engine(bounce_bytes=(1 << 64) - 1)))
        print(outcome(lambda: umbp.Engine(workers=1 << 40)))
        engine = umbp.Engine()
        print(outcome(lambda: engine.alloc_device(1 << 50)))
        # A sparse file of 8 TiB (ext4 takes up to 16): a read of all of it cannot fit.
        with open("huge.bin", "wb") as f:
            f.truncate(1 << 43)
        with engine.register_file("huge.bin", direct=False) as huge:
            print(outcome(lambda: engine.read(huge, 0, 1 << 43)))
            print(outcome(lambda: engine.read(huge, (1 << 43) - 4096, 4096)))
        """,
        tmp_path,
    )
    assert out == ["MemoryError", "MemoryError", "ValueError", "Error", "MemoryError", "ok"], out


def test_a_read_only_file_range_past_its_end_is_refused(engine, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\1" * (4 * PAGE))
    with pytest.raises(umbp.RegistrationError, match="past the end"):
        engine.register_file(path, 0, 5 * PAGE, writable=False)
    with pytest.raises(umbp.RegistrationError, match="past the end"):
        engine.register_file(path, 3 * PAGE, 2 * PAGE, writable=False)
    with pytest.raises(ValueError):
        engine.register_file(path, 5 * PAGE)  # the default length: to an end before the offset
    with engine.register_file(path, PAGE, writable=False) as whole:
        assert whole.length == 3 * PAGE
    # A writable range may reach past the end (an offload tier grows); `extend` sizes it now.
    with engine.register_file(path, 0, 8 * PAGE, extend=True) as grown:
        assert grown.length == 8 * PAGE
    assert path.stat().st_size == 8 * PAGE


def connector(engine, tmp_path, layers, block_bytes, blocks, **tiers):
    buffers = [np.zeros(blocks * block_bytes, dtype=np.uint8) for _ in range(layers)]
    regs = [engine.register(b) for b in buffers]
    kv = KVConnector(engine, regs, block_bytes, ssd_path=str(tmp_path / "kv.bin"), **tiers)
    return kv, buffers, regs


def test_a_save_layer_that_raises_publishes_nothing_and_keeps_no_slot(engine, tmp_path):
    # One DRAM slot: "A" takes it, "B" finds none and the call raises. Nothing of the call may
    # stay: not "A"'s slot, not its layer. Then "A" would be published with bytes never
    # written (zeros), and the slot would be gone for good.
    kv, buffers, regs = connector(engine, tmp_path, 1, 4096, 2, dram_slots=1, ssd_slots=1)
    buffers[0][:] = pattern(2 * 4096, 1)
    with pytest.raises(umbp.Error, match="no free dram slot"):
        kv.save_layer(0, [("A", 0), ("B", 1)])
    assert kv.wait_for_save() == []
    assert kv.finished() == (set(), set())
    with pytest.raises(KeyError):
        kv.start_load([("A", 0)])
    # The slot is free again: a whole save of "C" takes it and loads back its bytes.
    kv.save_layer(0, [("C", 1)])
    assert kv.wait_for_save() == []
    assert kv.finished() == (set(), {"C"})
    buffers[0][:] = 0
    kv.start_load([("C", 0)])
    assert kv.wait_for_layer(0, timeout=30) == []
    assert bytes(buffers[0][:4096]) == bytes(pattern(2 * 4096, 1)[4096:])
    kv.close()
    for r in regs:
        r.close()


def test_a_key_missing_the_layer_whose_save_raised_is_not_published(engine, tmp_path):
    kv, buffers, regs = connector(engine, tmp_path, 2, 4096, 2, dram_slots=1, ssd_slots=1)
    kv.store("old", "ssd", bytes(pattern(2 * 4096, 2)))
    with pytest.raises(umbp.Error):
        kv.save_layer(0, [("A", 0), ("B", 1)])
    kv.save_layer(1, [("A", 0)])  # "A" reserves the slot again; its layer 0 never saved
    with pytest.raises(ValueError):
        kv.save_layer(2, [("A", 0)])
    assert kv.wait_for_save() == ["A"]
    assert kv.finished() == (set(), set())
    assert set(kv.index) == {"old"}
    kv.store("D", "dram", bytes(2 * 4096))  # the DRAM slot went back
    kv.close()
    for r in regs:
        r.close()


def o_direct_dir_or_skip(tmp_path):
    """A directory whose filesystem takes O_DIRECT (tmpfs does not)."""
    for candidate in (tmp_path, "/var/tmp"):
        probe = os.path.join(candidate, f"o_direct_probe_{os.getpid()}")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            continue
        os.close(fd)
        os.unlink(probe)
        if hasattr(os, "O_DIRECT"):
            return candidate
    pytest.skip("no filesystem here takes O_DIRECT")


def test_sixteen_threads_save_and_load_pieces_sharing_sectors_of_an_o_direct_file(engine, tmp_path):
    # Blocks of 1,000 bytes: every 512-byte sector of the SSD tier holds pieces of two layers,
    # and each layer is saved by its own offload, in flight together. Every byte saved must
    # load back (a read-modify-write of a shared sector must not drop its neighbour's bytes).
    # UMBP_KV_ROUNDS=2000 runs the 2,000 rounds per thread (about 2.5 min on 2 CPUs).
    directory = o_direct_dir_or_skip(tmp_path)
    rounds = int(os.environ.get("UMBP_KV_ROUNDS", "50"))
    threads_n, layers, blocks, block_bytes = 16, 8, 4, 1000
    errors = []

    def worker(t):
        try:
            path = os.path.join(directory, f"kv_{os.getpid()}_{t}.bin")
            buffers = [np.zeros(blocks * block_bytes, dtype=np.uint8) for _ in range(layers)]
            regs = [engine.register(b) for b in buffers]
            kv = KVConnector(engine, regs, block_bytes, dram_slots=1, ssd_path=path, ssd_slots=2 * blocks, layers_per_group=2)
            try:
                for r in range(rounds):
                    seed = 1000 * t + r
                    for layer in range(layers):
                        buffers[layer][:] = pattern(blocks * block_bytes, seed * layers + layer)
                    expected = [bytes(b) for b in buffers]
                    keys = [(f"k{i}", i) for i in range(blocks)]
                    for layer in range(layers):
                        kv.save_layer(layer, keys, tier="ssd")
                    assert kv.wait_for_save() == []
                    for b in buffers:
                        b[:] = POISON
                    # Block i of each layer loads what was saved from block blocks - 1 - i.
                    kv.start_load([(f"k{i}", blocks - 1 - i) for i in range(blocks)])
                    assert kv.wait_for_load(timeout=60) == []
                    loaded, _ = kv.finished()
                    assert loaded == {f"k{i}" for i in range(blocks)}
                    for layer in range(layers):
                        for i in range(blocks):
                            at = (blocks - 1 - i) * block_bytes
                            got = bytes(buffers[layer][at:at + block_bytes])
                            want = expected[layer][i * block_bytes:(i + 1) * block_bytes]
                            assert got == want, f"thread {t} round {r} layer {layer} block {i}"
            finally:
                kv.close()
                for reg in regs:
                    reg.close()
                os.unlink(path)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} threads failed; first: {errors[0]}"
