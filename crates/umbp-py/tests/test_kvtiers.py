"""The tier index behind umbp.vllm's scheduler side (no vLLM needed)."""

import pytest

from umbp.kvtiers import DRAM, SSD, TierIndex


def saved(index, key, ranks=1):
    """Plans and completes a save of ``key`` on every rank; returns (tier, slot)."""
    op, tier, slot = index.begin_save(key)
    index.report(op, ok=ranks)
    return tier, slot


def test_a_block_is_a_hit_only_once_every_rank_saved_it():
    index = TierIndex(4, ranks=2)
    op, tier, slot = index.begin_save(b"a")
    assert (tier, slot) == (DRAM, 0)
    assert not index.is_hit(b"a")
    assert index.begin_save(b"a") is None  # being saved: not saved twice
    index.report(op, ok=1)
    assert not index.is_hit(b"a")
    index.report(op, ok=1)
    assert index.is_hit(b"a")
    assert index.count_hits([b"a", b"b", b"a"]) == 1


def test_a_save_failed_on_one_rank_is_a_miss_and_frees_its_slot():
    index = TierIndex(1, ranks=2)
    op, _, slot = index.begin_save(b"a")
    index.report(op, failed=1)
    index.report(op, ok=1)
    assert not index.is_hit(b"a") and index.entry(b"a") is None
    assert index.free_slots(DRAM) == 1
    assert index.begin_save(b"b")[2] == slot


def test_a_slot_being_read_is_not_reused_even_after_its_block_left():
    index = TierIndex(1, 0, dram_free_slots=0)
    saved(index, b"a")
    load, tier, slot = index.begin_load(b"a")
    assert index.clear() == 1  # the block leaves the index while its load runs
    assert index.begin_save(b"b") is None  # its slot is still read
    index.report(load, ok=1)
    assert index.begin_save(b"b")[1:] == (tier, slot)


def test_a_failed_load_drops_the_block():
    index = TierIndex(2)
    saved(index, b"a")
    op, _, _ = index.begin_load(b"a")
    index.report(op, failed=1)
    assert not index.is_hit(b"a")
    assert index.counters.failed_loads == 1


def test_pressure_demotes_the_least_recent_dram_blocks_to_ssd():
    index = TierIndex(4, 4, dram_free_slots=2)
    for key in (b"a", b"b", b"c"):
        saved(index, key)
    index.report(index.begin_load(b"a")[0], ok=1)  # a is now the most recent
    demotions = index.plan_demotions()
    assert len(demotions) == 1  # 1 free + 1 leaving = 2
    op, dram_slot, ssd_slot = demotions[0]
    assert index.entry(b"b").slot == dram_slot and index.entry(b"b").state == "demoting"
    assert index.is_hit(b"b")  # still loadable from DRAM meanwhile
    assert index.plan_demotions() == []  # already leaving
    index.report(op, ok=1)
    e = index.entry(b"b")
    assert (e.tier, e.slot, e.state) == (SSD, ssd_slot, "ready")
    assert index.free_slots(DRAM) == 2
    assert index.keys_in(DRAM) == [b"c", b"a"]


def test_a_full_dram_spills_saves_to_ssd_and_a_full_ssd_evicts_its_lru():
    index = TierIndex(1, 2, dram_free_slots=0)
    assert saved(index, b"a") == (DRAM, 0)
    assert saved(index, b"b") == (SSD, 0)
    assert saved(index, b"c") == (SSD, 1)
    assert saved(index, b"d") == (SSD, 0)  # b was the least recent SSD block
    assert index.entry(b"b") is None and index.is_hit(b"c")


def test_without_ssd_pressure_drops_blocks():
    index = TierIndex(2, 0, dram_free_slots=1)
    saved(index, b"a")
    saved(index, b"b")
    assert index.plan_demotions() == []
    assert index.entry(b"a") is None and index.is_hit(b"b")
    assert index.free_slots(DRAM) == 1


def test_a_failed_demotion_drops_the_block_and_frees_both_slots():
    index = TierIndex(1, 1, dram_free_slots=1)
    saved(index, b"a")
    ((op, _, _),) = index.plan_demotions()
    index.report(op, failed=1)
    assert index.entry(b"a") is None
    assert index.free_slots(DRAM) == 1 and index.free_slots(SSD) == 1


def test_no_slot_at_all_is_refused():
    with pytest.raises(ValueError):
        TierIndex(0, 0)
    index = TierIndex(1, 0, dram_free_slots=0)
    index.begin_save(b"a")
    assert index.begin_save(b"b") is None
    assert index.counters.saves_skipped == 1


def test_a_save_failed_early_is_never_a_hit_and_its_slot_waits_for_every_rank():
    # fail_save: the save's bytes are known wrong (computed over a failed load) while the
    # ranks still write them. The key can be saved anew at once, into another slot; the old
    # slot is reused only once every rank reported, and ok reports do not revive it.
    index = TierIndex(2, 0, ranks=2, dram_free_slots=0)
    op, tier, slot = index.begin_save(b"a")
    index.report(op, ok=1)
    assert index.fail_save(op)
    assert not index.fail_save(op)  # once
    assert index.entry(b"a") is None and index.counters.failed_saves == 1
    again, _, slot2 = index.begin_save(b"a")
    assert slot2 != slot and index.free_slots(DRAM) == 0
    index.report(op, ok=1)  # the last rank: the old slot goes free, "a" stays the new save's
    assert index.op_settled(op) and index.free_slots(DRAM) == 1
    assert index.entry(b"a").slot == slot2 and not index.is_hit(b"a")
    index.report(again, ok=2)
    assert index.is_hit(b"a") and index.entry(b"a").slot == slot2
    assert not index.fail_save(again)  # settled
    assert not index.fail_save(10**6)  # unknown


def test_residency_is_announced_when_a_block_becomes_loadable_and_when_it_stops():
    index = TierIndex(2, 1, dram_free_slots=1)
    seen = []
    index.on_residency = lambda key, tier, stored: seen.append((key, tier, stored))
    saved(index, b"a")
    assert seen == [(b"a", DRAM, True)]
    op, _, _ = index.begin_save(b"b")
    index.report(op, failed=1)  # never loadable: never announced
    assert seen == [(b"a", DRAM, True)]
    saved(index, b"c")
    ((demote, _, _),) = index.plan_demotions()  # a leaves DRAM for SSD
    assert seen[-1] == (b"c", DRAM, True)
    index.report(demote, ok=1)
    assert seen[-2:] == [(b"a", DRAM, False), (b"a", SSD, True)]
    saved(index, b"d")
    index.plan_demotions()  # c is next; the SSD tier drops a, its least recent, for it
    assert seen[-1] == (b"a", SSD, False)
    load, _, _ = index.begin_load(b"d")
    index.report(load, failed=1)  # a failed load drops d
    assert seen[-1] == (b"d", DRAM, False)
    index.clear(in_flight=True)  # c, being demoted, goes too
    assert seen[-1] == (b"c", DRAM, False)
    assert len(index) == 0


def test_a_reset_with_in_flight_fails_saves_and_demotions_started_before_it():
    index = TierIndex(4, 4, ranks=2, dram_free_slots=2)
    saved(index, b"a", ranks=2)
    saved(index, b"b", ranks=2)
    save, _, _ = index.begin_save(b"c")
    ((demote, _, _),) = index.plan_demotions()  # a, the least recent
    assert index.clear() == 1  # a plain reset drops b and keeps what is in flight
    assert index.is_hit(b"a")
    assert index.clear(in_flight=True) == 2  # c's save and a's demotion
    for op in (save, demote):
        index.report(op, ok=2)  # every rank completed them: still nothing from before
    assert index.entry(b"a") is None and index.entry(b"c") is None
    assert index.pending_ops() == 0
    # Every slot is free again once the ranks reported.
    assert index.free_slots(DRAM) == 4 and index.free_slots(SSD) == 4


def test_a_save_into_a_full_dram_only_tier_evicts_the_least_recent_block_no_one_reads():
    index = TierIndex(4, 0, dram_free_slots=0)
    for key in (b"a", b"b", b"c", b"d"):
        saved(index, key)
    load, _, a_slot = index.begin_load(b"a")  # a is read until its load settles
    for key in (b"b", b"c", b"d"):
        index.report(index.begin_load(key)[0], ok=1)
    assert index.keys_in(DRAM) == [b"a", b"b", b"c", b"d"]
    # Each save takes the slot of the least recent ready block, skipping a (being loaded)
    # and the blocks being saved.
    for key, evicted in ((b"e", b"b"), (b"f", b"c"), (b"g", b"d")):
        slot = index.entry(evicted).slot
        op, tier, got = index.begin_save(key)
        assert (tier, got) == (DRAM, slot) and index.entry(evicted) is None
        assert not index.is_hit(key)
    assert index.begin_save(b"h") is None  # a is read, e, f and g are being saved
    assert index.counters.saves_skipped == 1 and index.is_hit(b"a")
    index.report(load, ok=1)
    index.report(index.begin_load(b"a")[0], ok=1)  # a is the most recent again ...
    saved(index, b"e2")  # ... but the only ready block: it goes
    assert index.entry(b"a") is None and index.entry(b"e2").slot == a_slot
    assert index.counters.evictions[DRAM] == 4


def test_a_burst_of_saves_larger_than_the_headroom_is_stored_whole():
    index = TierIndex(64, 0, dram_free_slots=3)  # the watermark keeps 3 slots free
    for k in range(64):
        saved(index, ("old", k))
    assert len(index.plan_demotions()) == 0 and index.free_slots(DRAM) == 3
    ops = [index.begin_save(("new", k)) for k in range(40)]
    assert all(op is not None for op in ops)
    for op, _, _ in ops:
        index.report(op, ok=1)
    assert all(index.is_hit(("new", k)) for k in range(40))
    # The oldest went (3 for the headroom, 37 for the burst), the newest old ones stay.
    assert index.keys_in(DRAM)[:24] == [("old", k) for k in range(40, 64)]
    assert index.counters.saves_skipped == 0


def test_a_full_ssd_whose_blocks_are_all_busy_makes_room_in_dram():
    index = TierIndex(2, 1, dram_free_slots=0)
    saved(index, b"a")
    saved(index, b"b")
    ssd_save, tier, _ = index.begin_save(b"c")  # c is being saved into the only SSD slot
    assert tier == SSD
    op, tier, slot = index.begin_save(b"d")
    assert tier == DRAM and index.entry(b"a") is None and index.is_hit(b"b")
