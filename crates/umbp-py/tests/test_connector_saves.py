"""umbp.connector.KVConnector saving one key twice between two wait_for_save calls: the slot
is never written by two offloads at once, and the key loads as one block whole, never a mix of
two (no vLLM needed)."""

import os
import threading

import numpy as np
import pytest

import umbp
from umbp.connector import KVConnector

LAYERS = 40
BLOCK = 64 << 10  # bytes of one layer of one block: large enough for two writes to overlap
POISON = 0xA5


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def engine():
    return umbp.Engine()


def make(engine, tmp_path, name, blocks=3, slots=4):
    buffers = [np.zeros(blocks * BLOCK, dtype=np.uint8) for _ in range(LAYERS)]
    regs = [engine.register(b) for b in buffers]
    kv = KVConnector(
        engine,
        regs,
        BLOCK,
        dram_slots=slots,
        ssd_path=os.path.join(str(tmp_path), name),
        ssd_slots=slots,
        layers_per_group=8,
    )
    return kv, buffers, regs


def fill(buffers, seed):
    """Block b of every layer gets its own bytes; returns them, [layer][block]."""
    out = []
    for layer, b in enumerate(buffers):
        b[:] = pattern(len(b), seed * LAYERS + layer)
        out.append([bytes(b[i * BLOCK:(i + 1) * BLOCK]) for i in range(len(b) // BLOCK)])
    return out


def loaded_version(kv, buffers, key, versions, where):
    """Loads ``key`` into block 2 and returns which of ``versions`` (source blocks) every
    layer holds; fails on a layer that holds none of them, or on layers that disagree."""
    for b in buffers:
        b[2 * BLOCK:] = POISON
    kv.start_load([(key, 2)])
    assert kv.wait_for_load(timeout=60) == []
    loaded, _ = kv.finished()
    assert loaded == {key}
    found = []
    for layer, b in enumerate(buffers):
        got = bytes(b[2 * BLOCK:3 * BLOCK])
        match = [v for v, want in versions.items() if got == want[layer]]
        assert match, f"{where}: layer {layer} holds neither version whole"
        found.append(match[0])
    mixed = sorted(set(found))
    assert len(mixed) == 1, f"{where}: layers of blocks {mixed} mixed: {found}"
    return found[0]


@pytest.mark.parametrize("tier", ["dram", "ssd"])
@pytest.mark.parametrize("shape", ["two_calls", "one_call"])
def test_a_key_saved_twice_in_one_step_loads_as_one_block_whole(engine, tmp_path, tier, shape):
    # Per layer, the same key is saved from block 0 and from block 1 (different bytes): in
    # two save_layer calls, or twice in one. The old connector wrote both into one slot at
    # once (two offloads, or two objects of one), which tore the block.
    kv, buffers, regs = make(engine, tmp_path, "kv.bin")
    try:
        for r in range(8):
            want = fill(buffers, r)
            versions = {0: [w[0] for w in want], 1: [w[1] for w in want]}
            key = "k"  # each round replaces the last one's copy
            for layer in range(LAYERS):
                if shape == "two_calls":
                    kv.save_layer(layer, [(key, 0)], tier=tier)
                    kv.save_layer(layer, [(key, 1)], tier=tier)
                else:
                    kv.save_layer(layer, [(key, 0), (key, 1)], tier=tier)
            assert kv.wait_for_save() == []
            assert kv.finished()[1] == {key}
            # The first block given for the key is the one kept.
            assert loaded_version(kv, buffers, key, versions, f"round {r}") == 0
    finally:
        kv.close()
        for reg in regs:
            reg.close()


def test_the_same_block_saved_twice_is_saved_once_and_a_key_missing_layers_fails(engine, tmp_path):
    kv, buffers, regs = make(engine, tmp_path, "kv.bin")
    try:
        want = fill(buffers, 7)
        for layer in range(LAYERS):
            kv.save_layer(layer, [("a", 0)])
            kv.save_layer(layer, [("a", 0), ("b", 1)])
        # "c" is saved from block 0 for its first half of layers, block 1 for the rest: the
        # later block is skipped, so "c" misses layers and fails, rather than loading mixed.
        for layer in range(LAYERS):
            kv.save_layer(layer, [("c", 0 if layer < LAYERS // 2 else 1)])
        assert kv.wait_for_save() == ["c"]
        assert kv.finished()[1] == {"a", "b"}
        assert loaded_version(kv, buffers, "a", {0: [w[0] for w in want]}, "a") == 0
        assert loaded_version(kv, buffers, "b", {1: [w[1] for w in want]}, "b") == 1
        with pytest.raises(KeyError):
            kv.start_load([("c", 2)])
        # Two slots were taken ("a", "b"); "c"'s went back: two more saves fit.
        for layer in range(LAYERS):
            kv.save_layer(layer, [("d", 0), ("e", 1)])
        assert kv.wait_for_save() == []
    finally:
        kv.close()
        for reg in regs:
            reg.close()


def test_sixteen_threads_each_with_a_connector_save_keys_twice_and_load_them_whole(engine, tmp_path):
    # One engine shared by 16 threads, each driving its own connector (a connector is driven
    # by one thread at a time): every thread saves each key from two blocks in one step.
    errors = []

    def worker(t):
        try:
            kv, buffers, regs = make(engine, tmp_path, f"kv{t}.bin", slots=2)
            try:
                for r in range(3):
                    want = fill(buffers, 1000 * t + r)
                    versions = {0: [w[0] for w in want], 1: [w[1] for w in want]}
                    for layer in range(LAYERS):
                        kv.save_layer(layer, [("k", 0)], tier="ssd" if r % 2 else "dram")
                        kv.save_layer(layer, [("k", 1)], tier="ssd" if r % 2 else "dram")
                    assert kv.wait_for_save() == []
                    # Whichever version: whole in every layer (the old connector tore it).
                    loaded_version(kv, buffers, "k", versions, f"thread {t} round {r}")
            finally:
                kv.close()
                for reg in regs:
                    reg.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} threads failed; first: {errors[0]}"
