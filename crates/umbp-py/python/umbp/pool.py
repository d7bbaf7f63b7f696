"""The umbp pool from Python: one index of KV blocks shared by instances and nodes.

Two layers:

- :class:`PoolIndex` is the index itself (``umbp_pool::Index``): an embedded one in a redb
  file (one node, kept across restarts), or a cluster's shared one in Redis
  (``redis://:password@host:port/0``). Keys are 16-byte :class:`bytes` (vLLM's block hashes,
  or any 128-bit key). The calls keep the pool's rules: reserve a slot, write, publish with the
  CRC32C; lease what you load (a stale placement is not granted: a miss, never another block's
  bytes); release. Every call releases the GIL while it waits on Redis or the store.
- :class:`Pool` does that dance for you over an :class:`~umbp.Engine`: ``put`` keyed blocks
  from registered memory into a tier's slots (one reservation, one transfer batch, one
  publish), ``get`` them into registered memory (one lookup, one lease, one transfer batch
  verifying each block's checksum, one release), with one :class:`BlockResult` per key.

An embedded index outlives its process, and so do its durable tiers' files; after a crash they
may disagree (a truncated or replaced file). :meth:`PoolIndex.reconcile` (embedded only) takes
each durable tier's file as configured now, drops the blocks whose bytes cannot be what was
published (a missing or short file, a changed shape; with ``verify="sample"``/``"full"`` a
CRC32C that does not match) and returns a :class:`ReconcileReport` saying which and why. Call it
after opening, before the first lookup: the package's README ("A pool kept across restarts")
has the whole recipe, a ``durable=True`` SSD tier from ``register_file(..., create=True)``.

Example::

    import numpy as np, umbp

    engine = umbp.Engine(checksums="all_tiers")       # the pool loads only verified blocks
    index = umbp.PoolIndex("/tmp/pool.redb")          # or "redis://:secret@127.0.0.1:6379/0"
    pool = umbp.Pool(engine, index, node=0)
    arena = engine.register(np.zeros(64 * 4096, dtype=np.uint8))
    pool.add_tier(0, arena, slot_size=4096, slot_count=64)

    src = engine.register(np.full(4096, 7, dtype=np.uint8))
    key = (1).to_bytes(16, "big")
    assert pool.put(0, [(key, src, 0, 4096)])[0].status == "stored"
    dst = engine.register(np.zeros(4096, dtype=np.uint8))
    assert pool.get([(key, dst, 0, 4096)])[0].ok
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from . import _native
from ._native import Placement, PoolError, PoolIndex, ReconcileReport, Reservation

if TYPE_CHECKING:
    from . import Engine, Registration

__all__ = [
    "PoolIndex",
    "Pool",
    "Placement",
    "Reservation",
    "ReconcileReport",
    "PoolError",
    "BlockResult",
]


@dataclass(frozen=True)
class BlockResult:
    """One key's outcome of :meth:`Pool.put` or :meth:`Pool.get`.

    ``status``: for a put ``"stored"`` (written and published), ``"present"`` (the key was
    already in the pool) or ``"failed"`` (nothing published, its slot free again); for a get
    ``"loaded"`` (every byte in the destination, checksum verified), ``"miss"`` or
    ``"failed"`` (the destination's bytes are not to be used). ``placement``: where the block
    is, for stored, present and loaded keys. ``error``: why it failed."""

    status: str
    placement: Optional[Placement] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        """Whether the key is in the pool (a put) or was loaded (a get)."""
        return self.status in ("stored", "present", "loaded")


def _results(raw: List[Tuple[str, Optional[Placement], Optional[str]]]) -> List[BlockResult]:
    return [BlockResult(s, p, e) for s, p, e in raw]


class Pool:
    """Keyed blocks in and out of ``engine``'s registered memory over ``index``, as node
    ``node`` of the pool.

    The engine's checksum policy must cover the tiers added (``Engine(checksums="all_tiers")``
    for a DRAM tier; SSD files are covered by the default): the pool publishes a block only
    with the CRC32C its transfer reported, and reports a hit only when the loaded bytes match
    it. The node is announced in the index at once and renewed from a thread every third of
    ``announce_ttl`` seconds until :meth:`close`. A put's reservations last
    ``reservation_ttl`` seconds (a transfer still running at three quarters of it is
    cancelled and the block fails); a get's lease lasts ``lease_ttl`` seconds, renewed while
    its transfer runs. Thread-safe: any number of threads may put and get at once.

    Memory nodes: with an engine made with ``remote=True``, blocks placed on another node's
    tier (a memory node that announced its address and registered its exported regions as
    tiers 0, 1, ... in the index) are reached through the remote engine: connected on first
    use, its region registered, and connected again after the node restarts. A node that dies
    costs only its blocks (they fail; they are never reported loaded)."""

    def __init__(
        self,
        engine: "Engine",
        index: PoolIndex,
        *,
        node: int,
        address: str = "",
        reservation_ttl: float = 30.0,
        lease_ttl: float = 30.0,
        announce_ttl: float = 10.0,
    ) -> None:
        self._native = _native.Pool(
            engine._native,
            index,
            node=node,
            address=address,
            reservation_ttl=reservation_ttl,
            lease_ttl=lease_ttl,
            announce_ttl=announce_ttl,
        )
        self.index = index
        self._engine = engine

    def _transfers(self) -> "_native.Pool":
        """The native pool, for a call that moves bytes through the engine:
        :class:`~umbp.ClosedError` once the engine was closed (index-only calls still work)."""
        if self._engine.closed:
            raise _native.ClosedError("the engine is closed")
        return self._native

    @property
    def node(self) -> int:
        """This pool's node."""
        return self._native.node

    def add_tier(
        self,
        tier: int,
        registration: "Registration",
        *,
        slot_size: int,
        slot_count: int,
        base: int = 0,
        durable: bool = False,
        low: Optional[int] = None,
        high: Optional[int] = None,
    ) -> None:
        """Adds tier ``tier`` of this node: ``slot_count`` slots of ``slot_size`` bytes from
        byte ``base`` of ``registration`` (a DRAM arena or an SSD file of the engine), and
        registers it with the index (``durable``: its bytes survive a restart; ``low`` /
        ``high``: eviction watermarks in free slots). Raises :class:`PoolError` (``kind``
        ``"invalid_config"``) for a registration too short, or one the engine's checksum
        policy does not cover, and ``"tier_conflict"`` for another shape under the same
        tier."""
        self._transfers().add_tier(
            tier, registration, slot_size, slot_count, base=base, durable=durable, low=low, high=high
        )

    def put(
        self,
        tier: int,
        blocks: Sequence[Tuple[bytes, "Registration", int, int]],
        *,
        node: Optional[int] = None,
    ) -> List[BlockResult]:
        """Stores ``blocks``, each ``(key, registration, offset, length)`` (the block's bytes
        in registered memory), in tier ``tier`` of node ``node`` (default: this pool's; a
        memory node's tier is reached through the engine's remote tier). One result per
        block, in order. Raises :class:`PoolError` only when the index could not be reached
        (nothing stored)."""
        return _results(self._transfers().put(tier, list(blocks), node=node))

    def get(self, blocks: Sequence[Tuple[bytes, "Registration", int, int]]) -> List[BlockResult]:
        """Loads ``blocks``, each ``(key, registration, offset, capacity)`` (where its bytes
        go, and how many fit), from wherever the pool holds them. One result per block, in
        order; a block whose bytes do not match its checksum fails and leaves the pool.
        Raises :class:`PoolError` only when the index could not be reached (nothing loaded)."""
        return _results(self._transfers().get(list(blocks)))

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        """Whether each key is in the pool (one lookup)."""
        return self._native.exists(list(keys))

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are in the pool (one lookup)."""
        return self._native.prefix_hits(list(keys))

    def remove(self, keys: Sequence[bytes]) -> List[str]:
        """Removes keys: per key ``"removed"``, ``"absent"`` or ``"leased"`` (a reader holds
        it; it stays)."""
        return self._native.remove(list(keys))

    def metrics(self) -> Dict[str, int]:
        """The counters: ``hits``, ``misses``, ``stale`` (misses found by the lookup whose slot
        was reused by the lease), ``checksum_failures``, ``get_failures``, ``stored``,
        ``present``, ``put_failures``."""
        return self._native.metrics()

    def leave(self) -> bool:
        """Leaves the pool now, for a planned stop: stops renewing the node's announcement and
        withdraws it, so other instances miss its blocks at once instead of failing their loads
        until the announcement expires (on Redis its blocks are dropped; a new pool of the node
        rejoins empty). Returns whether the node was alive."""
        return self._native.leave()

    def close(self) -> None:
        """Stops renewing the node's announcement and lets go of the tiers' registrations;
        later calls raise :class:`~umbp.ClosedError`. Idempotent."""
        self._native.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
