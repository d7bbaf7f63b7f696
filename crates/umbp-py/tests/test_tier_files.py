"""Tier files: an exclusive registration keeps every other instance off its file, and blocks
far past the SSD engine's maximum segment (1 MiB) move through the SSD tier byte-exact."""

import errno

import numpy as np
import pytest

import umbp


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97) >> 7).astype(np.uint8)


def test_an_exclusive_tier_file_refuses_a_second_instance_until_the_first_lets_go(tmp_path):
    path = tmp_path / "tier.bin"
    path.write_bytes(bytes(1 << 16))
    first_engine, second_engine = umbp.Engine(), umbp.Engine()
    first = first_engine.register_file(path, 0, 1 << 16, exclusive=True)
    # Another instance in the process (another engine), and the same engine again: refused in
    # words that say what to do, with nothing registered.
    for engine in (second_engine, first_engine):
        with pytest.raises(umbp.RegistrationError, match="its own path") as refused:
            engine.register_file(path, 0, 1 << 16, exclusive=True)
        assert refused.value.errno == errno.EWOULDBLOCK
        assert "locked by another process or engine instance" in str(refused.value)
    # Registrations that do not ask for the lock still may (the lock is advisory).
    with second_engine.register_file(path, 0, 1 << 16):
        pass
    first.close()
    with second_engine.register_file(path, 0, 1 << 16, exclusive=True) as second:
        assert second.kind == "file"


def test_blocks_with_8_mib_ranges_round_trip_through_the_ssd_tier_byte_exact(tmp_path):
    from umbp.connector import KVConnector

    engine = umbp.Engine()
    layers, blocks, block_bytes = 3, 2, 8 << 20  # each layer's range: 8 MiB, one fragment
    buffers = [engine.register(np.zeros(blocks * block_bytes, dtype=np.uint8)) for _ in range(layers)]
    kv = KVConnector(engine, buffers, block_bytes, dram_slots=1, ssd_path=str(tmp_path / "kv.bin"), ssd_slots=2, layers_per_group=1)
    try:
        # A block put into the SSD tier, loaded back into block 1 of every layer.
        stored = bytes(pattern(layers * block_bytes, 11))
        kv.store("stored", "ssd", stored)
        kv.start_load([("stored", 1)])
        for layer in range(layers):
            assert kv.wait_for_layer(layer, timeout=60) == []
        assert kv.wait_for_load(timeout=60) == []
        assert kv.finished()[0] == {"stored"}
        for layer in range(layers):
            got = engine.read(buffers[layer], block_bytes, block_bytes)
            assert got == stored[layer * block_bytes:(layer + 1) * block_bytes], f"layer {layer}"

        # A block saved layer by layer from block 0 into the SSD tier, then loaded into block 1.
        saved = bytes(pattern(layers * block_bytes, 12))
        for layer in range(layers):
            engine.write(buffers[layer], 0, saved[layer * block_bytes:(layer + 1) * block_bytes])
            kv.save_layer(layer, [("saved", 0)], tier="ssd")
        assert kv.wait_for_save() == []
        assert kv.finished()[1] == {"saved"}
        kv.start_load([("saved", 1)])
        for layer in range(layers):
            assert kv.wait_for_layer(layer, timeout=60) == []
        for layer in range(layers):
            got = engine.read(buffers[layer], block_bytes, block_bytes)
            assert got == saved[layer * block_bytes:(layer + 1) * block_bytes], f"layer {layer}"
    finally:
        kv.close()
        for b in buffers:
            b.close()
