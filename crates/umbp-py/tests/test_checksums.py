"""Block checksums from Python: an offload reports each block's CRC32C, a restore given it
verifies it, and a block whose bytes changed in its tier fails alone with the mismatch kind."""

import numpy as np
import pytest

import umbp

PAGE = 16 << 10


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97) >> 7).astype(np.uint8)


def mismatches(text):
    """The sum of `umbp_checksum_mismatches_total` over its labels."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("umbp_checksum_mismatches_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def save_and_corrupt(engine, tier_of, corrupt):
    """Saves two blocks of 3 pages into the tier `tier_of` registers, changes one byte of
    block 1 with `corrupt(page_offset)`, restores both with their recorded checksums into
    device memory; returns the report, the source and the restored bytes."""
    src = pattern(6 * PAGE, 3)
    pages = [[9 * PAGE, 2 * PAGE, 5 * PAGE], [1 * PAGE, 12 * PAGE, 7 * PAGE]]
    with engine.register(src) as s, tier_of() as tier, engine.alloc_device(6 * PAGE) as kv:
        saved = engine.offload([
            umbp.Object(b, tier, pages[b], PAGE, 3 * PAGE, [umbp.Range(0, 3 * PAGE, s, b * 3 * PAGE)])
            for b in range(2)
        ]).raise_for_errors()
        sums = [o.checksum for o in saved.objects]
        assert all(isinstance(c, int) for c in sums), saved
        corrupt(pages[1][1] + 100)
        report = engine.restore([
            umbp.Object(b, tier, pages[b], PAGE, 3 * PAGE,
                        [umbp.Range(0, PAGE, kv, b * 3 * PAGE),
                         umbp.Range(PAGE, 2 * PAGE, kv, b * 3 * PAGE + PAGE, group=1)],
                        checksum=sums[b])
            for b in range(2)
        ])
        restored = engine.read(kv, 0, 6 * PAGE)
    return report, src, restored, sums


def check(engine, report, src, restored, sums):
    first, second = report.objects
    assert first.ok and first.checksum == sums[0], report
    assert restored[:3 * PAGE] == bytes(src[:3 * PAGE])
    assert second.state is umbp.State.FAILED, report
    assert isinstance(second.error, umbp.TransferError)
    assert second.error.kind is umbp.FailureKind.CHECKSUM_MISMATCH
    assert second.error.kind == "checksum_mismatch"
    assert second.error.tag == 1
    assert second.checksum is not None and second.checksum != sums[1]
    assert mismatches(engine.metrics_text()) == 1
    assert engine.metrics()["checksums"]["mismatches"] == 1


def test_a_corrupted_ssd_block_fails_alone_with_the_mismatch_kind(tmp_path):
    engine = umbp.Engine()  # checksums="files_and_remote": SSD loads are verified by default
    path = tmp_path / "tier.bin"
    path.write_bytes(b"\0" * (16 * PAGE))

    def corrupt(offset):
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x40]))

    report, src, restored, sums = save_and_corrupt(
        engine, lambda: engine.register_file(path), corrupt)
    check(engine, report, src, restored, sums)


def test_a_corrupted_dram_block_fails_alone_where_dram_is_checked():
    engine = umbp.Engine(checksums=umbp.ChecksumPolicy.ALL_TIERS)
    dram = np.zeros(16 * PAGE, dtype=np.uint8)

    def corrupt(offset):
        dram[offset] ^= 0x40

    report, src, restored, sums = save_and_corrupt(engine, lambda: engine.register(dram), corrupt)
    check(engine, report, src, restored, sums)


def test_the_policy_decides_which_tiers_are_checked():
    dram = pattern(4 * PAGE, 5)
    for policy, checked in [("off", False), ("files_and_remote", False), ("all_tiers", True)]:
        engine = umbp.Engine(checksums=policy)
        out = np.zeros(PAGE, dtype=np.uint8)
        with engine.register(dram) as tier, engine.register(out) as d:
            obj = umbp.Object(0, tier, [2 * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, d, 0)],
                              checksum=0x1234)
            result = engine.restore([obj]).objects[0]
        assert result.ok is not checked, (policy, result)
        assert (result.checksum is not None) is checked
    with pytest.raises(ValueError):
        umbp.Engine(checksums="sometimes")
