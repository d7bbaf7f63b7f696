"""Where cached KV blocks live: the index a KV connector's scheduler side keeps over a DRAM
tier and an optional SSD tier (no inference server needed; :mod:`umbp.vllm` uses it).

A block is named by its *key* (an inference server's block hash, which chains the hashes of
the blocks before it, so equal keys mean equal prefixes) and stored in one *slot* of a tier:
``slot_bytes`` bytes holding every layer of the block. The index only decides; the workers
move the bytes. Each decision it hands out is an *operation* with an id (a save into a slot,
a load out of one, a demotion from a DRAM slot to an SSD slot), and the index learns how it
ended from :meth:`TierIndex.report`, once per worker (``ranks``: every tensor-parallel rank
runs the same operation on its own shard of the tiers). Until every rank reported:

- a block being saved is not a hit (nothing may read it before every rank wrote it);
- a slot being read (a load, a demotion) is not reused (``pins``), even once its block left
  the index;
- a failed save or a failed demotion drops the block (a miss later), a failed load drops it
  too (its bytes are not trusted again);
- a save whose bytes are known wrong before the ranks report it (:meth:`TierIndex.fail_save`:
  computed over a block whose load failed) fails whatever they report; its block leaves the
  index at once, so it can be saved anew, while its slot stays taken until every rank reported.

Eviction: each tier is LRU (a hit or a completed save makes a block the most recent). When
fewer than ``dram_free_slots`` DRAM slots are free, :meth:`TierIndex.plan_demotions` moves the
least recent ready DRAM blocks to the SSD tier (the SSD tier drops its own least recent ready
block to make room); without an SSD tier they are dropped. A save that finds no free DRAM slot
goes straight to the SSD tier; one that finds no slot there either (no SSD tier, or every SSD
block busy) evicts the least recent ready DRAM block no operation reads, so a burst of saves
larger than the headroom ``dram_free_slots`` keeps is stored whole while older blocks can go.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Set, Tuple

__all__ = ["DRAM", "SSD", "TierIndex", "Entry"]

#: The tiers' names, as they appear in connector metadata, stats and metrics.
DRAM = "dram"
SSD = "ssd"

#: Entry states.
SAVING = "saving"
READY = "ready"
DEMOTING = "demoting"


class _Slots:
    """The slots of one tier: free ones (lowest first, so a tier fills from its start),
    pinned ones (read by an operation in flight) and retiring ones (freed while pinned)."""

    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count))  # a heap
        self._pins: Dict[int, int] = {}
        self._retiring: Set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> Optional[int]:
        return heapq.heappop(self._free) if self._free else None

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def pinned(self, slot: int) -> bool:
        return slot in self._pins

    def unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._retiring:
            self._retiring.discard(slot)
            heapq.heappush(self._free, slot)

    def release(self, slot: int) -> None:
        """Frees ``slot`` now, or once the last operation reading it ended."""
        if slot in self._pins:
            self._retiring.add(slot)
        else:
            heapq.heappush(self._free, slot)


@dataclass
class Entry:
    """A cached block: its tier and slot, and whether it is ``"saving"`` (not yet a hit),
    ``"ready"``, or ``"demoting"`` (a hit in DRAM while its copy to SSD is under way)."""

    key: Hashable
    tier: str
    slot: int
    state: str


@dataclass
class _Op:
    kind: str  # "save", "load", "demote"
    key: Hashable
    tier: str
    slot: int
    ssd_slot: int = -1  # the destination of a demotion
    reports: int = 0
    failed: bool = False
    abandoned: bool = False  # a save failed early (fail_save): its slot is pinned, not owned


@dataclass
class Counters:
    """What the index did since it was made (monotonic)."""

    hits: Dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0})
    saves: Dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0})
    saves_skipped: int = 0
    demotions: int = 0
    evictions: Dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0})
    failed_saves: int = 0
    failed_loads: int = 0
    failed_demotions: int = 0


class TierIndex:
    """The index over ``dram_slots`` DRAM slots and ``ssd_slots`` SSD slots (0: no SSD tier),
    for ``ranks`` workers. ``dram_free_slots``: how many DRAM slots demotion keeps free."""

    def __init__(
        self, dram_slots: int, ssd_slots: int = 0, *, ranks: int = 1, dram_free_slots: int = 1
    ):
        if dram_slots < 0 or ssd_slots < 0:
            raise ValueError("slot counts must not be negative")
        if dram_slots + ssd_slots == 0:
            raise ValueError(
                "the tiers hold no slot: give DRAM or SSD bytes for at least one block"
            )
        if ranks < 1:
            raise ValueError("ranks must be at least 1")
        self.ranks = ranks
        self.dram_free_slots = max(0, min(dram_free_slots, dram_slots))
        self._slots = {DRAM: _Slots(dram_slots), SSD: _Slots(ssd_slots)}
        self._entries: Dict[Hashable, Entry] = {}
        # key -> None, least recent first
        self._lru: Dict[str, "OrderedDict[Hashable, None]"] = {
            DRAM: OrderedDict(),
            SSD: OrderedDict(),
        }
        self._ops: Dict[int, _Op] = {}
        self._next_op = 1
        self.counters = Counters()
        #: Called as ``(key, tier, True)`` when a block becomes loadable in a tier (every
        #: rank's save completed, or a demotion landed on SSD) and ``(key, tier, False)`` when
        #: it stops being (evicted, dropped after a failure, cleared, demoted out of DRAM);
        #: a block whose save never completed is never announced. A connector's KV events.
        self.on_residency: Optional[Callable[[Hashable, str, bool], None]] = None

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: Hashable) -> Optional[Entry]:
        """The block stored under ``key``, if any (in any state)."""
        return self._entries.get(key)

    def is_hit(self, key: Hashable) -> bool:
        """Whether ``key`` can be loaded now (every rank's save of it completed)."""
        e = self._entries.get(key)
        return e is not None and e.state != SAVING

    def count_hits(self, keys: Iterable[Hashable]) -> int:
        """How many of ``keys``, from the first, can be loaded now (a prefix)."""
        n = 0
        for key in keys:
            if not self.is_hit(key):
                break
            n += 1
        return n

    def free_slots(self, tier: str) -> int:
        return self._slots[tier].free

    def keys_in(self, tier: str) -> List[Hashable]:
        """The keys stored in ``tier``, least recently used first."""
        return list(self._lru[tier])

    def pending_ops(self) -> int:
        """Operations some rank has not reported yet."""
        return len(self._ops)

    def op_settled(self, op_id: int) -> bool:
        """Whether every rank reported operation ``op_id`` (or it never existed)."""
        return op_id not in self._ops

    def op_key(self, op_id: int) -> Optional[Hashable]:
        """The key operation ``op_id`` is about (None once it settled, or never existed)."""
        op = self._ops.get(op_id)
        return None if op is None else op.key

    # -- decisions -------------------------------------------------------------------------

    def _op(self, op: _Op) -> int:
        op_id = self._next_op
        self._next_op += 1
        self._ops[op_id] = op
        return op_id

    def _touch(self, e: Entry) -> None:
        self._lru[e.tier][e.key] = None
        self._lru[e.tier].move_to_end(e.key)

    def _drop(self, e: Entry) -> None:
        """Removes ``e`` from the index and frees its slot (once no operation reads it)."""
        del self._entries[e.key]
        self._lru[e.tier].pop(e.key, None)
        self._slots[e.tier].release(e.slot)
        if e.state != SAVING and self.on_residency is not None:
            self.on_residency(e.key, e.tier, False)

    def begin_load(self, key: Hashable) -> Tuple[int, str, int]:
        """Plans loading ``key`` (which must be a hit): ``(op id, tier, slot)``. The slot stays
        pinned until every rank reported the load."""
        e = self._entries[key]
        if e.state == SAVING:
            raise ValueError(f"{key!r} is still being saved")
        self._slots[e.tier].pin(e.slot)
        self._touch(e)
        self.counters.hits[e.tier] += 1
        return self._op(_Op("load", key, e.tier, e.slot)), e.tier, e.slot

    def _evict_lru(self, tier: str) -> bool:
        """Drops the least recent ready block of ``tier`` that no operation reads, so its slot
        is free at once; False if there is none."""
        slots = self._slots[tier]
        for key in self._lru[tier]:
            e = self._entries[key]
            if e.state == READY and not slots.pinned(e.slot):
                self._drop(e)
                self.counters.evictions[tier] += 1
                return True
        return False

    def _take(self, tier: str) -> Optional[int]:
        slots = self._slots[tier]
        if slots.count == 0:
            return None
        slot = slots.take()
        if slot is None and tier == SSD and self._evict_lru(SSD):
            slot = slots.take()
        return slot

    def begin_save(self, key: Hashable) -> Optional[Tuple[int, str, int]]:
        """Plans saving ``key``: ``(op id, tier, slot)``, or None when it is stored already
        (or being saved) or no slot can be had. DRAM first, then SSD (which evicts its least
        recent ready block when full), then the least recent ready DRAM block (evicted; never
        one being saved, loaded or demoted)."""
        if key in self._entries:
            return None
        for tier in (DRAM, SSD):
            slot = self._take(tier)
            if slot is not None:
                break
        else:
            # No free slot anywhere: an older block makes room (plan_demotions' headroom is
            # only what it frees between steps, far less than one burst of saves may need).
            tier = DRAM
            slot = self._slots[DRAM].take() if self._evict_lru(DRAM) else None
            if slot is None:
                self.counters.saves_skipped += 1
                return None
        self._entries[key] = Entry(key, tier, slot, SAVING)
        self.counters.saves[tier] += 1
        return self._op(_Op("save", key, tier, slot)), tier, slot

    def fail_save(self, op_id: int) -> bool:
        """Fails save ``op_id`` now, whatever the ranks report (its bytes are known wrong):
        its block leaves the index at once, so a new save of the key can be planned, and its
        slot is reused only once every rank reported the save (they may still write it).
        Returns whether it did (False for an unknown or settled id, or not a save)."""
        op = self._ops.get(op_id)
        if op is None or op.kind != "save" or op.abandoned:
            return False
        op.failed = True
        op.abandoned = True
        self._slots[op.tier].pin(op.slot)
        e = self._entries.get(op.key)
        if e is not None and e.tier == op.tier and e.slot == op.slot:
            self._drop(e)  # the slot is pinned: it frees when the save settles
        self.counters.failed_saves += 1
        return True

    def plan_demotions(self) -> List[Tuple[int, int, int]]:
        """Frees DRAM down to ``dram_free_slots`` free slots: ``[(op id, DRAM slot, SSD slot)]``
        to copy. A demoting block stays a DRAM hit until every rank copied it; without an SSD
        tier (or with every SSD block busy) the least recent ready DRAM blocks are dropped."""
        out = []
        dram = self._slots[DRAM]
        # Blocks already on their way out count as freed.
        leaving = sum(1 for op in self._ops.values() if op.kind == "demote")
        candidates = [k for k in self._lru[DRAM] if self._entries[k].state == READY]
        for key in candidates:
            if dram.free + leaving >= self.dram_free_slots:
                break
            e = self._entries[key]
            ssd_slot = self._take(SSD)
            if ssd_slot is None:
                self._drop(e)
                self.counters.evictions[DRAM] += 1
                continue
            e.state = DEMOTING
            dram.pin(e.slot)
            leaving += 1
            self.counters.demotions += 1
            out.append((self._op(_Op("demote", key, DRAM, e.slot, ssd_slot)), e.slot, ssd_slot))
        return out

    # -- outcomes --------------------------------------------------------------------------

    def report(self, op_id: int, ok: int = 0, failed: int = 0) -> None:
        """Records that ``ok`` ranks completed operation ``op_id`` and ``failed`` ranks did
        not. Once every rank reported, the operation's outcome applies. Unknown ids (already
        settled) are ignored."""
        op = self._ops.get(op_id)
        if op is None:
            return
        op.reports += ok + failed
        op.failed = op.failed or failed > 0
        if op.reports < self.ranks:
            return
        del self._ops[op_id]
        # The block the operation was about, if it is still stored where the operation saw it.
        e = self._entries.get(op.key)
        if e is not None and (e.tier != op.tier or e.slot != op.slot):
            e = None
        if op.kind == "save":
            if op.abandoned:  # fail_save dropped its block and pinned the slot
                self._slots[op.tier].unpin(op.slot)
            elif e is None:  # cannot happen: a block being saved is never dropped otherwise
                self._slots[op.tier].release(op.slot)
            elif op.failed:
                self.counters.failed_saves += 1
                self._drop(e)
            else:
                e.state = READY
                self._touch(e)
                if self.on_residency is not None:
                    self.on_residency(e.key, e.tier, True)
        elif op.kind == "load":
            self._slots[op.tier].unpin(op.slot)
            if op.failed:
                self.counters.failed_loads += 1
                if e is not None:
                    self._drop(e)
        elif op.kind == "demote":
            self._slots[DRAM].unpin(op.slot)
            if e is None or e.state != DEMOTING:  # dropped meanwhile (a failed load of it)
                self._slots[SSD].release(op.ssd_slot)
            elif op.failed:
                self.counters.failed_demotions += 1
                self._slots[SSD].release(op.ssd_slot)
                self._drop(e)
            else:
                self._lru[DRAM].pop(e.key, None)
                self._slots[DRAM].release(e.slot)
                e.tier, e.slot, e.state = SSD, op.ssd_slot, READY
                self._touch(e)
                if self.on_residency is not None:
                    self.on_residency(e.key, DRAM, False)
                    self.on_residency(e.key, SSD, True)

    def clear(self, *, in_flight: bool = False) -> int:
        """Forgets every ready block (a cache reset); blocks in flight stay, unless
        ``in_flight``: then saves in flight fail whatever the ranks report (as
        :meth:`fail_save`: their bytes were computed before the reset) and blocks being demoted
        leave too, so nothing from before the reset is ever a hit. Returns how many blocks were
        dropped."""
        dropped = 0
        if in_flight:
            for op_id, op in list(self._ops.items()):
                if op.kind == "save" and self.fail_save(op_id):
                    dropped += 1
        states = (READY, DEMOTING) if in_flight else (READY,)
        ready = [e for e in self._entries.values() if e.state in states]
        for e in ready:
            self._drop(e)
        return dropped + len(ready)
