"""umbp.connector.KVConnector verifies what it loads: a block saved layer by layer records the
CRC32C of its whole slot (joined from the per-layer offloads' checksums with
umbp.crc32c_combine), and a load of a slot whose bytes changed since fails that key alone, as a
load error, after which the key is a miss (no vLLM needed)."""

import os
import zlib

import numpy as np
import pytest

import umbp
from umbp.connector import KVConnector

LAYERS = 6
BLOCK = 8 << 10  # bytes of one layer of one block
POISON = 0xA5


def crc32c(data: bytes) -> int:
    """A plain bitwise CRC-32C (Castagnoli), the reference the engine's hardware one must
    equal."""
    crc = 0xFFFFFFFF
    table = _table()
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_TABLE = []


def _table():
    if not _TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _TABLE.append(c)
    return _TABLE


def test_crc32c_combine_joins_the_checksums_of_two_pieces():
    rng = np.random.default_rng(7)
    for a_len, b_len in [(0, 5), (5, 0), (1, 1), (100, 4096), (4096, 100), (3, 70000)]:
        a = rng.integers(0, 256, a_len, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, b_len, dtype=np.uint8).tobytes()
        assert umbp.crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    # CRC-32C is not zlib's CRC-32: the reference above is the right polynomial.
    assert crc32c(b"123456789") == 0xE3069283 != zlib.crc32(b"123456789")
    with pytest.raises(OverflowError):
        umbp.crc32c_combine(-1, 0, 1)


def make(engine, tmp_path, blocks=3, slots=4):
    buffers = [np.zeros(blocks * BLOCK, dtype=np.uint8) for _ in range(LAYERS)]
    regs = [engine.register(b) for b in buffers]
    kv = KVConnector(
        engine,
        regs,
        BLOCK,
        dram_slots=slots,
        ssd_path=os.path.join(str(tmp_path), "kv.bin"),
        ssd_slots=slots,
        layers_per_group=2,
    )
    return kv, buffers, regs


@pytest.mark.parametrize("policy", ["files_and_remote", "all_tiers"])
@pytest.mark.parametrize("tier", ["ssd", "dram"])
def test_a_changed_slot_fails_its_key_alone_and_is_forgotten(tmp_path, policy, tier):
    engine = umbp.Engine(checksums=policy)
    kv, buffers, regs = make(engine, tmp_path)
    rng = np.random.default_rng(1)
    try:
        for b in buffers:
            b[:] = rng.integers(0, 256, len(b), dtype=np.uint8)
        want = {k: [bytes(b[k * BLOCK:(k + 1) * BLOCK]) for b in buffers] for k in (0, 1)}
        for layer in range(LAYERS):
            kv.save_layer(layer, [("good", 0), ("bad", 1)], tier=tier)
        assert kv.wait_for_save() == []
        assert kv.finished()[1] == {"good", "bad"}
        # What the connector recorded is the CRC32C of the whole slot, layer after layer.
        checked = tier == "ssd" or policy == "all_tiers"
        for key in ("good", "bad"):
            expect = crc32c(b"".join(want[0 if key == "good" else 1])) if checked else None
            assert kv.index[key][2] == expect, key

        # One byte of "bad"'s slot changes behind the connector's back (layer 3 of it).
        reg, slot, _ = kv.index["bad"]
        at = slot * kv.slot_bytes + 3 * BLOCK + 100
        if tier == "ssd":
            with open(kv.ssd_path, "r+b") as f:
                f.seek(at)
                old = f.read(1)
                f.seek(at)
                f.write(bytes([old[0] ^ 0x01]))
        else:
            kv.arena[at] ^= 0x01

        for b in buffers:
            b[2 * BLOCK:] = POISON
        kv.start_load([("good", 2)])
        assert kv.wait_for_load(timeout=60) == []
        assert kv.finished()[0] == {"good"}
        assert [bytes(b[2 * BLOCK:3 * BLOCK]) for b in buffers] == want[0]

        kv.start_load([("bad", 2), ("good", 1)])
        failed = kv.wait_for_load(timeout=60)
        loaded, _ = kv.finished()
        if not checked:
            # A tier the policy leaves unhashed loads what it holds: the changed byte arrives.
            assert failed == [] and loaded == {"bad", "good"}
            assert bytes(buffers[3][2 * BLOCK + 100:2 * BLOCK + 101]) != want[1][3][100:101]
            return
        assert failed == ["bad"] and loaded == {"good"}
        assert "bad" not in kv.index, "a slot that failed its checksum is forgotten"
        assert [bytes(b[BLOCK:2 * BLOCK]) for b in buffers] == want[0]
        assert engine.metrics()["checksums"]["mismatches"] == 1
        # Saved anew (from block 1, which now holds "good"'s bytes), the key loads whole again.
        resaved = [bytes(b[BLOCK:2 * BLOCK]) for b in buffers]
        for layer in range(LAYERS):
            kv.save_layer(layer, [("bad", 1)], tier=tier)
        assert kv.wait_for_save() == []
        kv.finished()
        kv.start_load([("bad", 2)])
        assert kv.wait_for_load(timeout=60) == []
        assert kv.finished()[0] == {"bad"}
        assert [bytes(b[2 * BLOCK:3 * BLOCK]) for b in buffers] == resaved
    finally:
        kv.close()
        for reg in regs:
            reg.close()
