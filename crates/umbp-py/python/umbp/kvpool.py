"""The pool as a KV connector's index: what :mod:`umbp.vllm`'s scheduler side keeps instead of
an in-process :class:`umbp.kvtiers.TierIndex` when ``kv_connector_extra_config`` names a pool
(``"pool": "redis://..."`` shared by every instance, or ``"embedded"``, a redb file beside the
SSD tier that keeps the index across restarts). No inference server is needed here.

The index is :class:`umbp.PoolIndex` (crate ``umbp-pool``): block keys to placements (node,
tier, slot, length, CRC32C, generation) with two-phase writes, leases and generations. This
module maps a connector's blocks onto it:

- **Keys, per rank.** Each tensor-parallel rank stores its own shard of a block (its KV heads)
  in a tier of its own, so each rank's shard is a pool block of its own, keyed by
  ``blake2b-128(namespace | block hash | rank)``. The namespace names what makes the bytes of
  one hash differ (model, cache dtype, KV layout, block size, page bytes, layers, TP size), so
  instances of other models or shapes sharing the pool never hit each other's blocks. Each
  rank's placement carries the CRC32C of that rank's bytes, and that rank verifies its load
  against it. A block is a hit when every rank's key is published on a tier its rank can read.
- **Tiers.** This instance is one node of the pool (``node``); rank ``r``'s DRAM arena is tier
  ``2r``, its SSD file tier ``2r + 1``. Saves go to the SSD tier when there is one (durable,
  and readable by the other instances of the host), else to the DRAM arena (volatile, loaded
  by this instance only). The pool's eviction (least recently used, between watermarks)
  replaces the in-process index's DRAM-to-SSD demotion.
- **Another instance's SSD file** is found through its node announcement (the address is a
  JSON object naming the host and each tier's file); a worker opens it read-only.
- **Memory nodes** (``umbp-ucx-serve --pool``, with ``memory_nodes=True``): a node whose
  announcement's address is ``host:port`` exports its writable regions as tiers ``0, 1, ...``
  of its own slot size. Their placements are hits (every rank reaches them through its remote
  engine), and ``save_to`` sends saves there: :data:`SAVE_MEMORY_NODES` spread over the
  memory-node tiers by their free bytes (each save to the tier with the most left after the
  saves before it in the step), this instance's own tier when none has room;
  :data:`SAVE_MEMORY_NODES_ONLY` skips a save that finds no room (counted in
  :attr:`PoolCounters.no_room`). A rank's reference to such a slot names the node's address,
  tier and slot size (:data:`RankRef`).
- **Operations.** As with :class:`~umbp.kvtiers.TierIndex`, each decision is an operation the
  workers report once per rank. A load's placements are leased (one lease per batch of loads)
  until every rank reported it; a placement whose lease is refused (evicted, reused under a new
  generation, its node gone) is handed to the workers as a failure, so vLLM recomputes that
  block. A save reserves a slot per rank (``reserve_many``); it is published, with each rank's
  checksum, only once every rank reported its bytes landed, and aborted otherwise
  (:meth:`PoolTierIndex.fail_save` too).
- **Faults.** An index that cannot be reached costs hits, never bytes: a lookup that fails is a
  miss, a lease that fails makes those blocks load errors, a reservation or publish that fails
  is a failed save (counted in :class:`PoolCounters`, logged), and all resume once the index
  answers again (the node's announcement and tiers are renewed by a background thread).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

__all__ = [
    "PoolTierIndex",
    "PoolCounters",
    "RankRef",
    "pool_key",
    "tier_id",
    "remote_ref",
    "REMOTE",
    "SAVE_LOCAL",
    "SAVE_MEMORY_NODES",
    "SAVE_MEMORY_NODES_ONLY",
    "SAVE_TO",
]

logger = logging.getLogger(__name__)

#: Tier names, as :mod:`umbp.kvtiers` spells them, and a memory node's tier.
DRAM = "dram"
SSD = "ssd"
REMOTE = "remote"

#: Where saves go (``pool_save_to``): this instance's own tier; a memory node's, else this
#: instance's own; a memory node's only.
SAVE_LOCAL = "local"
SAVE_MEMORY_NODES = "memory_nodes"
SAVE_MEMORY_NODES_ONLY = "memory_nodes_only"
SAVE_TO = (SAVE_LOCAL, SAVE_MEMORY_NODES, SAVE_MEMORY_NODES_ONLY)

#: What one rank does for one pooled operation: ``(file, file_bytes, slot, checksum)``.
#: ``file`` is None for this rank's own tier (the operation's tier); another instance's SSD
#: file to read (``file_bytes`` long); or a memory node's tier, ``"ucx://HOST:PORT/TIER/
#: SLOT_SIZE"`` (:func:`remote_ref`; ``file_bytes``: the tier's bytes). ``slot`` is -1 where
#: the rank must fail the block without moving anything (a lease refused); ``checksum`` is
#: what a load verifies.
RankRef = Tuple[Optional[str], int, int, Optional[int]]

#: The prefix of a memory node's tier in a :data:`RankRef`.
UCX = "ucx://"

#: A rank's part of a load that must fail without moving anything.
_FAIL: RankRef = (None, 0, -1, None)


def tier_id(rank: int, tier: str) -> int:
    """The pool tier id of rank ``rank``'s ``tier`` on its node."""
    return 2 * rank + (1 if tier == SSD else 0)


def remote_ref(where: str) -> Optional[Tuple[str, int, int]]:
    """``(address, tier, slot size)`` of a :data:`RankRef`'s memory-node tier, or None when
    ``where`` names a file."""
    if not where.startswith(UCX):
        return None
    address, tier, slot_size = where[len(UCX) :].rsplit("/", 2)
    return address, int(tier), int(slot_size)


def _instance(address: str) -> Optional[Dict[str, Any]]:
    """The announcement of a vLLM instance (a JSON object), or None (a memory node's
    ``host:port``)."""
    if not address.startswith("{"):
        return None
    try:
        info = json.loads(address)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def pool_key(namespace: bytes, block_hash: Hashable, rank: int) -> bytes:
    """The 16-byte pool key of rank ``rank``'s shard of the block ``block_hash``."""
    h = hashlib.blake2b(digest_size=16, key=namespace[:64])
    raw = block_hash if isinstance(block_hash, bytes) else repr(block_hash).encode()
    h.update(raw)
    h.update(rank.to_bytes(4, "little"))
    return h.digest()


@dataclass
class PoolCounters:
    """What the pool index did since it was made (monotonic)."""

    lookups: int = 0
    hits: Dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0, REMOTE: 0})
    saves: Dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0, REMOTE: 0})
    published: int = 0
    #: Saves whose key another writer published first (its bytes are what lookups find).
    lost: int = 0
    saves_skipped: int = 0
    failed_saves: int = 0
    failed_loads: int = 0
    #: Blocks whose lease was refused (evicted, reused, node gone): load errors.
    leases_refused: int = 0
    #: Calls to the index that failed (unreachable, an error): each cost hits or saves only.
    index_errors: int = 0
    #: Saves that found no memory node with room (``save_to`` memory nodes only): skipped.
    no_room: int = 0
    #: Saves a memory node refused (no room, gone) that went to this instance's tier instead.
    fell_back: int = 0


@dataclass
class _Op:
    kind: str  # "save", "load"
    key: Hashable  # the block hash
    tier: str
    refs: List[RankRef]
    reservations: List[Any] = field(default_factory=list)  # saves: one per rank
    checksums: Dict[int, int] = field(default_factory=dict)  # saves: rank -> CRC32C
    lease: int = 0  # loads: the lease id
    placements: List[Any] = field(default_factory=list)  # loads: to lease, one per rank
    keys: List[bytes] = field(default_factory=list)  # the pool keys, one per rank
    reports: int = 0
    failed: bool = False
    abandoned: bool = False


class PoolTierIndex:
    """A connector's index over the pool ``client`` (a :class:`umbp.PoolIndex`), for node
    ``node`` with ``ranks`` tensor-parallel ranks. ``slot_bytes``: a slot of each rank's tier;
    ``dram_slots``/``ssd_slots``: each rank's tier sizes; ``ssd_files``: each rank's SSD file
    (for other instances to find); ``namespace``: bytes naming the KV shape (see the module).
    ``memory_nodes``: the workers reach memory nodes (their blocks are hits); ``save_to``: one
    of :data:`SAVE_TO` (memory nodes need ``memory_nodes``).

    An embedded ``client`` (``client.embedded``) outlives no process but its file does, and so
    do this node's SSD files: before anything else the index is reconciled with them
    (:meth:`umbp.PoolIndex.reconcile`, ``verify``: ``"none"``, ``"sample"`` or ``"full"``), so
    blocks of a file truncated, replaced or gone since are misses rather than load errors;
    what it dropped is logged and kept in :attr:`reconciled`."""

    def __init__(
        self,
        client: Any,
        *,
        node: int,
        ranks: int,
        slot_bytes: int,
        object_bytes: int,
        dram_slots: int,
        ssd_slots: int,
        ssd_files: Sequence[Optional[str]] = (),
        namespace: bytes,
        lease_s: float = 30.0,
        reserve_s: float = 120.0,
        announce_s: float = 15.0,
        host: Optional[str] = None,
        memory_nodes: bool = False,
        save_to: str = SAVE_LOCAL,
        verify: str = "sample",
    ):
        if ranks < 1:
            raise ValueError("ranks must be at least 1")
        if save_to not in SAVE_TO:
            raise ValueError(f"save_to must be one of {SAVE_TO}")
        if save_to != SAVE_LOCAL and not memory_nodes:
            raise ValueError("saving to memory nodes needs memory_nodes (a remote engine)")
        if dram_slots + ssd_slots == 0 and save_to != SAVE_MEMORY_NODES_ONLY:
            raise ValueError(
                "the tiers hold no slot: give DRAM or SSD bytes for at least one block"
            )
        self.client = client
        self.node = int(node)
        self.ranks = ranks
        self.slot_bytes = slot_bytes
        self.object_bytes = object_bytes
        self.namespace = namespace
        self.lease_s = lease_s
        self.reserve_s = reserve_s
        self.announce_s = announce_s
        self.host = host or socket.gethostname()
        #: The tier saves go to: the SSD file when there is one.
        self.tier = SSD if ssd_slots else DRAM
        self.slots = ssd_slots if ssd_slots else dram_slots
        self.ssd_files = list(ssd_files) if ssd_slots else []
        self.memory_nodes = memory_nodes
        self.save_to = save_to
        self.counters = PoolCounters()
        self._ops: Dict[int, _Op] = {}
        self._next_op = 1
        self._saving: Dict[Hashable, int] = {}  # block hash -> its save op in flight
        self._planned: List[int] = []  # save ops not yet reserved
        self._to_lease: List[int] = []  # load ops not yet leased
        #: Called as (key, tier, stored) by the in-process index for KV events; the pool's
        #: blocks are shared, so this index never calls it.
        self.on_residency: Optional[Callable[[Hashable, str, bool], None]] = None
        self._to_publish: List[Tuple[Any, int]] = []
        self._to_abort: List[Any] = []
        self._to_remove: List[bytes] = []
        self._leases: Dict[int, Tuple[int, float]] = {}  # lease id -> (loads unsettled, taken at)
        self._lease_bad: Dict[int, List[bytes]] = {}  # lease id -> keys whose load failed
        self._found: Dict[Hashable, List[Any]] = {}  # block hash -> placements, last lookup
        self._keys: Dict[Hashable, List[bytes]] = {}
        self._files: Dict[int, Dict[int, Tuple[str, int]]] = {}  # node -> tier -> (file, bytes)
        self._files_at = 0.0
        #: Memory nodes alive at the last look: node -> address; (node, tier) -> free bytes
        #: announced; (node, tier) -> (slot size, slot count), or None where unknown.
        self._mem_nodes: Dict[int, str] = {}
        self._mem_free: Dict[Tuple[int, int], int] = {}
        self._specs: Dict[Tuple[int, int], Optional[Tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._warned_at = 0.0
        #: What the reconcile at start found (an embedded index with SSD files), else None.
        self.reconciled: Optional[Any] = None
        if self.ssd_files and getattr(client, "embedded", False):
            self._reconcile(verify)
        try:
            self._join()
        except Exception as e:  # the index unreachable at start: the thread keeps trying
            self._error("joining the pool", e)

    def _reconcile(self, verify: str) -> None:
        """Makes the embedded index agree with this node's SSD files (before the first
        lookup, and before :meth:`_join` registers the tiers: a tier resized since is
        reshaped here rather than refused). A failure is logged: the loads still verify
        every block's checksum."""
        files = [
            (self.node, tier_id(r, SSD), self.slot_bytes, self.slots, path, 0)
            for r, path in enumerate(self.ssd_files)
            if path
        ]
        try:
            report = self.client.reconcile(files, verify)
        except ValueError:
            raise
        except Exception as e:
            logger.warning(
                "umbp pool: reconciling the index with the SSD files failed (loads still "
                "verify each block): %s",
                e,
            )
            return
        self.reconciled = report
        if report.dropped:
            reasons: Dict[str, int] = {}
            for _, reason, _ in report.dropped:
                reasons[reason] = reasons.get(reason, 0) + 1
            first = report.dropped[0]
            logger.warning(
                "umbp pool: the SSD files disagree with the index: dropped %d block(s) (%s), "
                "kept %d; first: tier %d slot %d, %s %s",
                len(report.dropped),
                ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())),
                report.kept,
                first[0].tier,
                first[0].slot,
                first[1],
                first[2],
            )
        else:
            logger.info(
                "umbp pool: index and SSD files agree: %d block(s) kept, %d verified (%d bytes)",
                report.kept,
                report.verified,
                report.bytes_read,
            )

    # -- the node's presence ---------------------------------------------------------------

    def _address(self) -> str:
        files = {
            str(tier_id(r, SSD)): [path, self.slots * self.slot_bytes]
            for r, path in enumerate(self.ssd_files)
            if path
        }
        return json.dumps({"umbp": "vllm", "host": self.host, "files": files}, sort_keys=True)

    def _join(self) -> None:
        """Announces this node (its tiers, their files) and registers its tiers: at start and
        on each renewal, so it rejoins by itself after the index lost it (a Redis restart)."""
        c = self.client
        c.announce(
            self.node,
            self._address(),
            [(tier_id(r, self.tier), 0) for r in range(self.ranks) if self.slots],
            self.announce_s,
        )
        for r in range(self.ranks if self.slots else 0):
            c.register_tier(
                self.node,
                tier_id(r, self.tier),
                self.slot_bytes,
                self.slots,
                durable=self.tier == SSD,
            )

    def start(self) -> None:
        """Starts the thread that renews the announcement and the leases held."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._renew_loop, name="umbp-pool", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        period = max(0.05, self.announce_s / 3)
        while not self._stop.wait(period):
            try:
                self._join()
            except Exception as e:
                self._error("renewing this node's announcement", e)
            self.renew_leases()

    def renew_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [lid for lid, (_, at) in self._leases.items() if now - at > self.lease_s / 3]
        for lid in due:
            try:
                self.client.renew(lid, self.lease_s)
                with self._lock:
                    if lid in self._leases:
                        self._leases[lid] = (self._leases[lid][0], now)
            except Exception as e:  # expired, or the index unreachable: the loads verify
                self._error("renewing a lease", e)

    def close(self) -> None:
        """A planned stop: stops the renewal thread, hands back what this index holds and
        withdraws the node, so other instances miss its blocks at once instead of failing
        their loads until its announcement expires (best effort: an unreachable index lets
        the announcement expire)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.flush()
        try:
            self.client.leave(self.node)
        except Exception as e:
            self._error("leaving the pool", e)

    def _error(self, what: str, e: BaseException) -> None:
        self.counters.index_errors += 1
        now = time.monotonic()
        if now - self._warned_at > 5.0:
            self._warned_at = now
            logger.warning("umbp pool: %s failed (hits and saves are lost meanwhile): %s", what, e)

    # -- keys and reachability --------------------------------------------------------------

    def keys_of(self, key: Hashable) -> List[bytes]:
        """The pool keys of block ``key``, one per rank."""
        ks = self._keys.get(key)
        if ks is None:
            if len(self._keys) > (1 << 18):
                self._keys.clear()
            ks = [pool_key(self.namespace, key, r) for r in range(self.ranks)]
            self._keys[key] = ks
        return ks

    def _look(self) -> None:
        """Reads the nodes alive now: the SSD files of this host's other instances and the
        memory nodes' addresses and free bytes. An index that cannot answer keeps the last
        view."""
        self._files_at = time.monotonic()
        try:
            nodes = self.client.nodes()
        except Exception as e:
            self._error("reading the pool's nodes", e)
            return
        files: Dict[int, Dict[int, Tuple[str, int]]] = {}
        mem: Dict[int, str] = {}
        free: Dict[Tuple[int, int], int] = {}
        for node_id, address, tiers in nodes:
            node_id = int(node_id)
            info = _instance(address)
            if info is None:
                if self.memory_nodes and node_id != self.node and ":" in address:
                    mem[node_id] = address
                    for t, f in tiers:
                        free[(node_id, int(t))] = int(f)
                continue
            if info.get("host") != self.host:
                continue
            try:
                files[node_id] = {
                    int(t): (str(p), int(n)) for t, (p, n) in info.get("files", {}).items()
                }
            except (ValueError, TypeError, AttributeError):
                continue
        self._files, self._mem_nodes, self._mem_free = files, mem, free

    def _peer_files(self, node: int) -> Optional[Dict[int, Tuple[str, int]]]:
        files = self._files.get(node)
        if files is None and node not in self._mem_nodes and self._stale(1.0):
            self._look()
            files = self._files.get(node)
        return files

    def _stale(self, after: float) -> bool:
        return time.monotonic() - self._files_at > after

    def _spec(self, node: int, tier: int) -> Optional[Tuple[int, int]]:
        """(slot size, slot count) of a memory node's tier (fixed per node id), or None."""
        key = (node, tier)
        if key not in self._specs:
            try:
                spec = self.client.tier_spec(node, tier)
            except Exception as e:
                self._error("reading a memory node's tier", e)
                return None
            self._specs[key] = None if spec is None else (int(spec[0]), int(spec[1]))
        return self._specs[key]

    def _mem_ref(self, node: int, tier: int, slot: int, checksum: Optional[int]) -> Optional[RankRef]:
        """How a rank reaches slot ``slot`` of memory node ``node``'s tier ``tier``, or None
        (not a memory node alive at the last look, its tier unknown or too small)."""
        address = self._mem_nodes.get(node)
        if address is None:
            return None
        spec = self._spec(node, tier)
        if spec is None or spec[0] < self.object_bytes or not 0 <= slot < spec[1]:
            return None
        size, count = spec
        return (f"{UCX}{address}/{tier}/{size}", size * count, slot, checksum)

    def _ref(self, rank: int, p: Any) -> Optional[RankRef]:
        """How rank ``rank`` reads placement ``p``, or None when it cannot."""
        if int(p.length) != self.object_bytes:
            return None
        node, tier = int(p.node), int(p.tier)
        if node == self.node and tier == tier_id(rank, self.tier):
            return (None, 0, int(p.slot), int(p.checksum))
        if self.memory_nodes and node != self.node:
            if node not in self._mem_nodes and node not in self._files and self._stale(1.0):
                self._look()
            if node in self._mem_nodes:
                return self._mem_ref(node, tier, int(p.slot), int(p.checksum))
        if tier % 2 == 0:
            return None  # a DRAM arena of another process (or rank)
        if node == self.node:
            r = (tier - 1) // 2
            if r < len(self.ssd_files) and self.ssd_files[r]:
                size = self.slots * self.slot_bytes
                return (self.ssd_files[r], size, int(p.slot), int(p.checksum))
            return None
        files = self._peer_files(node)
        if not files or tier not in files:
            return None
        path, size = files[tier]
        if (int(p.slot) + 1) * self.slot_bytes > size:
            return None
        return (path, size, int(p.slot), int(p.checksum))

    # -- queries ------------------------------------------------------------------------------

    def count_hits(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys`` (block hashes), from the first, every rank can load now: one
        batched lookup of every rank's key. Remembers the placements for :meth:`begin_load`."""
        keys = list(keys)
        if not keys:
            return 0
        pool_keys = [k for key in keys for k in self.keys_of(key)]
        self.counters.lookups += 1
        if self.memory_nodes and self._stale(5.0):
            self._look()  # a memory node that moved or left since
        try:
            found = self.client.lookup(pool_keys)
        except Exception as e:
            self._error("a lookup", e)
            return 0
        # The hot loop of a long prompt (62,500 blocks): a placement on this rank's own tier is
        # checked inline; only others go through _ref (another instance's file).
        ranks, node, size = self.ranks, self.node, self.object_bytes
        own = [tier_id(r, self.tier) for r in range(ranks)]
        saving, kept = self._saving, self._found
        n = 0
        for i, key in enumerate(keys):
            base = i * ranks
            ps = found[base : base + ranks]
            for r, p in enumerate(ps):
                if p is None:
                    return n
                if (p.node != node or p.tier != own[r] or p.length != size) and self._ref(
                    r, p
                ) is None:
                    return n
            if key in saving:
                return n
            kept[key] = ps
            n += 1
        return n

    def is_hit(self, key: Hashable) -> bool:
        """Whether block ``key`` can be loaded now (every rank's key published and readable)."""
        return self.count_hits([key]) == 1

    def entry(self, key: Hashable) -> None:
        """Nothing: the pool's blocks are not entries of this process (KV events, which ask,
        are the in-process index's)."""
        return None

    def pending_ops(self) -> int:
        """Operations some rank has not reported yet."""
        return len(self._ops)

    def op_settled(self, op_id: int) -> bool:
        """Whether every rank reported operation ``op_id`` (or it never existed)."""
        return op_id not in self._ops

    def __len__(self) -> int:
        return len(self._saving)

    # -- decisions ----------------------------------------------------------------------------

    def _op(self, op: _Op) -> int:
        op_id = self._next_op
        self._next_op += 1
        self._ops[op_id] = op
        return op_id

    def begin_load(self, key: Hashable) -> Tuple[int, str, int]:
        """Plans loading ``key`` (found by the last :meth:`count_hits`): ``(op id, tier, slot
        of rank 0)``. Its placements are leased by the next :meth:`commit`, with every other
        load planned until then."""
        # Kept until the step's commit: another request of this step may load it too.
        ps = self._found.get(key)
        refs = [self._ref(r, p) for r, p in enumerate(ps)] if ps else []
        if not ps or any(ref is None for ref in refs):
            op_id = self._op(_Op("load", key, self.tier, [_FAIL] * self.ranks))
            self._to_lease.append(op_id)
            return op_id, self.tier, -1
        good = [ref for ref in refs if ref is not None]
        where = good[0][0]
        tier = self.tier if where is None else REMOTE if where.startswith(UCX) else SSD
        op_id = self._op(_Op("load", key, tier, good, placements=list(ps)))
        self._to_lease.append(op_id)
        return op_id, tier, good[0][2]

    def commit(self) -> Dict[int, List[RankRef]]:
        """Takes one lease over every load planned since the last call and reserves every
        rank's slot for every save planned (one ``reserve_many`` per rank): op id -> what each
        rank does. A load whose lease was refused gets slot -1 on every rank (each rank reports
        it failed: vLLM recomputes it). A save that did not get every rank's slot is settled
        now (its slots aborted) and is absent."""
        out = self._lease_planned()
        out.update(self._reserve_planned())
        self._found.clear()
        return out

    def _lease_planned(self) -> Dict[int, List[RankRef]]:
        ops, self._to_lease = self._to_lease, []
        placements = [p for o in ops for p in self._ops[o].placements]
        granted: List[bool] = [False] * len(placements)
        lease_id = 0
        if placements:
            try:
                lid, flags = self.client.lease(placements, self.lease_s)
                lease_id, granted = int(lid), [bool(g) for g in flags]
            except Exception as e:
                self._error("a lease", e)
        out: Dict[int, List[RankRef]] = {}
        held = at = 0
        for o in ops:
            op = self._ops[o]
            n = len(op.placements)
            if n and all(granted[at : at + n]):
                op.lease = lease_id
                held += 1
                self.counters.hits[op.tier] += 1
            else:
                self.counters.leases_refused += 1
                op.refs = [_FAIL] * self.ranks
            at += n
            op.placements = []
            out[o] = op.refs
        if lease_id:
            if held:
                with self._lock:
                    self._leases[lease_id] = (held, time.monotonic())
            else:
                self._release(lease_id)
        return out

    def begin_save(self, key: Hashable) -> Optional[Tuple[int, str, int]]:
        """Plans saving ``key``: ``(op id, tier, -1)``; its slots are reserved by
        :meth:`reserve_planned`. None when this index saves it already."""
        if key in self._saving:
            return None
        op_id = self._op(_Op("save", key, self.tier, []))
        self._saving[key] = op_id
        self._planned.append(op_id)
        return op_id, self.tier, -1

    def tier_of(self, op_id: int) -> str:
        """The tier operation ``op_id`` reads or writes (a save's: where its slots were
        reserved, known after :meth:`commit`)."""
        op = self._ops.get(op_id)
        return op.tier if op is not None else self.tier

    def _reserve_planned(self) -> Dict[int, List[RankRef]]:
        ops, self._planned = self._planned, []
        ops = [o for o in ops if o in self._ops and not self._ops[o].abandoned]
        if not ops:
            return {}
        out: Dict[int, List[RankRef]] = {}
        left = ops
        if self.save_to != SAVE_LOCAL:
            targets = self._save_targets()
            refs = [(f"{UCX}{a}/{t}/{size}", size * count) for _, t, a, size, count in targets]
            # The saves spread over the nodes by free bytes (each to the one with the most
            # left after those before it), so one step's saves do not all land on one node.
            free = [self._mem_free.get((n, t), 0) for n, t, _, _, _ in targets]
            spread: List[List[int]] = [[] for _ in targets]
            for o in left:
                i = max(range(len(targets)), key=lambda j: free[j]) if targets else -1
                if i < 0:
                    break
                spread[i].append(o)
                free[i] -= self.object_bytes * self.ranks
            if targets:
                left = []
                for (node, tier, _, _, _), ref, ops in zip(targets, refs, spread):
                    if ops:
                        left += self._reserve_on(ops, node, [tier] * self.ranks, REMOTE, out, ref)
            # What a node had no room for tries the others, the most free bytes first.
            for (node, tier, _, _, _), ref in zip(targets, refs):
                if not left:
                    return out
                left = self._reserve_on(left, node, [tier] * self.ranks, REMOTE, out, ref)
            if not left:
                return out
            if self.save_to == SAVE_MEMORY_NODES_ONLY or not self.slots:
                for o in left:
                    self.counters.no_room += 1
                    self._settle(o)
                self._warn_no_room(len(left))
                return out
            self.counters.fell_back += len(left)
        if left:
            tiers = [tier_id(r, self.tier) for r in range(self.ranks)]
            for o in self._reserve_on(left, self.node, tiers, self.tier, out, None):
                self.counters.saves_skipped += 1
                self._settle(o)
        return out

    def _save_targets(self) -> List[Tuple[int, int, str, int, int]]:
        """The memory nodes' tiers a save may go to, the most free bytes first: ``(node,
        tier, address, slot size, slot count)``."""
        if self._stale(1.0):
            self._look()
        out = []
        for (node, tier), free in sorted(self._mem_free.items(), key=lambda x: -x[1]):
            address = self._mem_nodes.get(node)
            spec = self._spec(node, tier)
            if address is not None and spec is not None and spec[0] >= self.object_bytes:
                out.append((node, tier, address, spec[0], spec[1]))
        return out

    def _warn_no_room(self, n: int) -> None:
        now = time.monotonic()
        if now - self._warned_at > 5.0:
            self._warned_at = now
            logger.warning(
                "umbp pool: %d saves skipped: no memory node has room (none alive, or every "
                "slot reserved or leased)",
                n,
            )

    def _reserve_on(
        self,
        ops: List[int],
        node: int,
        tiers: List[int],
        tier: str,
        out: Dict[int, List[RankRef]],
        remote: Optional[Tuple[str, int]],
    ) -> List[int]:
        """Reserves every rank's slot of each of ``ops`` on ``node`` (rank r's in tier
        ``tiers[r]``), one ``reserve_many`` per rank; a save that got them all goes into
        ``out``. Returns the saves that some rank could not reserve there (no room, the node
        gone): each rank's slots that were had are aborted. A save whose key is published
        already is settled (skipped); so is everything when the index cannot be reached."""
        per_rank: List[List[Any]] = []
        try:
            for r in range(self.ranks):
                items = [(self.keys_of(self._ops[o].key)[r], self.object_bytes) for o in ops]
                per_rank.append(
                    list(self.client.reserve_many(node, tiers[r], items, self.reserve_s))
                )
        except Exception as e:
            self._error("a reservation", e)
            for rs in per_rank:
                self._to_abort.extend(x for x in rs if _is_slot(x))
            for o in ops:
                self.counters.saves_skipped += 1
                self._settle(o)
            return []
        retry = []
        for j, o in enumerate(ops):
            got = [per_rank[r][j] for r in range(self.ranks)]
            op = self._ops[o]
            if all(_is_slot(x) for x in got):
                op.reservations = [_slot(x) for x in got]
                op.tier = tier
                if remote is None:
                    op.refs = [(None, 0, int(res.slot), None) for res in op.reservations]
                else:
                    where, size = remote
                    op.refs = [(where, size, int(res.slot), None) for res in op.reservations]
                self.counters.saves[tier] += 1
                out[o] = op.refs
                continue
            # The ranks' slots that were had go back.
            self._to_abort.extend(_slot(x) for x in got if _is_slot(x))
            if any(_is_placement(x) for x in got):
                # Published already (another instance, or an earlier save).
                self.counters.saves_skipped += 1
                self._settle(o)
            else:
                retry.append(o)  # no slot here: elsewhere, or skipped
        return retry

    def fail_save(self, op_id: int) -> bool:
        """Fails save ``op_id`` now, whatever the ranks report: it is never published; its
        reservations are aborted once every rank reported (they may still be writing)."""
        op = self._ops.get(op_id)
        if op is None or op.kind != "save" or op.abandoned:
            return False
        op.failed = op.abandoned = True
        if self._saving.get(op.key) == op_id:
            del self._saving[op.key]
        self.counters.failed_saves += 1
        return True

    def plan_demotions(self) -> List[Tuple[int, int, int]]:
        """Nothing: the pool evicts by itself (least recently used, between watermarks)."""
        return []

    # -- outcomes -----------------------------------------------------------------------------

    def _settle(self, op_id: int) -> None:
        op = self._ops.pop(op_id)
        if op.kind == "save" and self._saving.get(op.key) == op_id:
            del self._saving[op.key]

    def report(
        self, op_id: int, ok: int = 0, failed: int = 0, checksums: Optional[Dict[int, int]] = None
    ) -> None:
        """Records that ``ok`` ranks completed operation ``op_id`` and ``failed`` did not;
        ``checksums``: rank -> CRC32C of what a save wrote. Once every rank reported, a save
        is queued for publishing (all ok, every rank's checksum known) or aborting, a load's
        lease share is released; :meth:`flush` sends them."""
        op = self._ops.get(op_id)
        if op is None:
            return
        op.reports += ok + failed
        op.failed = op.failed or failed > 0
        if checksums:
            op.checksums.update(checksums)
        if op.reports < self.ranks:
            return
        self._settle(op_id)
        if op.kind == "save":
            if not op.reservations:
                return
            whole = len(op.checksums) == self.ranks and all(
                op.checksums.get(r) is not None for r in range(self.ranks)
            )
            if op.failed or not whole:
                if not op.abandoned:
                    self.counters.failed_saves += 1
                self._to_abort.extend(op.reservations)
            else:
                self._to_publish.extend(
                    (res, int(op.checksums[r])) for r, res in enumerate(op.reservations)
                )
        else:
            if op.failed:
                self.counters.failed_loads += 1
            if not op.lease:
                return  # refused: nothing was read, nothing held
            if op.failed:
                # Its bytes are not trusted again: removed once this index's lease on them
                # ends (a removal answers "leased" while any lease holds them).
                self._lease_bad.setdefault(op.lease, []).extend(self.keys_of(op.key))
            with self._lock:
                left, at = self._leases.get(op.lease, (1, 0.0))
                if left > 1:
                    self._leases[op.lease] = (left - 1, at)
                    return
                self._leases.pop(op.lease, None)
            self._release(op.lease)
            self._to_remove.extend(self._lease_bad.pop(op.lease, []))

    def _release(self, lease_id: int) -> None:
        try:
            self.client.release(lease_id)
        except Exception as e:  # it expires by itself
            self._error("releasing a lease", e)

    def flush(self) -> None:
        """Publishes the saves every rank completed, aborts the failed ones and removes blocks
        whose load failed: one call each."""
        pub, self._to_publish = self._to_publish, []
        if pub:
            try:
                results = self.client.publish(pub)
            except Exception as e:
                self._error("a publish", e)
                self.counters.failed_saves += len(pub) // self.ranks
                self._to_abort.extend(res for res, _ in pub)
            else:
                # Each save's ranks are consecutive: it is published when every rank's shard
                # is (this save's or, where another writer won a key, that writer's).
                kinds = [_published(r) for r in results]
                for j in range(0, len(kinds), self.ranks):
                    mine = kinds[j : j + self.ranks]
                    if "expired" in mine:
                        self.counters.failed_saves += 1
                    elif "lost" in mine:
                        self.counters.lost += 1
                    else:
                        self.counters.published += 1
        abort, self._to_abort = self._to_abort, []
        if abort:
            try:
                self.client.abort(abort)
            except Exception as e:  # the reservations expire by themselves
                self._error("an abort", e)
        remove, self._to_remove = self._to_remove, []
        if remove:
            try:
                self.client.remove(remove)
            except Exception as e:
                self._error("removing blocks whose load failed", e)

    def clear(self, *, in_flight: bool = False) -> int:
        """A cache reset: forgets what this index remembers of past lookups, and with
        ``in_flight`` fails the saves in flight (as :meth:`fail_save`). The pool itself is
        shared by other instances, so nothing published is removed from it. Returns how many
        saves failed."""
        self._found.clear()
        failed = 0
        if in_flight:
            for op_id, op in list(self._ops.items()):
                if op.kind == "save" and self.fail_save(op_id):
                    failed += 1
        return failed


def _is_slot(x: Any) -> bool:
    """Whether a ``reserve_many`` answer is a reservation (not the placement of a key
    published already, not the error of that item)."""
    return type(x).__name__ == "Reservation"


def _is_placement(x: Any) -> bool:
    """Whether a ``reserve_many`` answer is the placement of a key published already."""
    return type(x).__name__ == "Placement"


def _slot(x: Any) -> Any:
    return x


def _published(x: Any) -> str:
    """"won", "lost" or "expired" of a ``publish`` answer (``(kind, placement)``)."""
    return str(x[0])

