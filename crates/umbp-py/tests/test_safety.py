"""What Python cannot be allowed to break: a registration closed from many threads at once
ends before any close returns; only buffers of plain numbers and bytes register; sizes too big
for the machine raise instead of aborting."""

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
