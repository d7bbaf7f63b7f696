"""The SGLang backend's pages in the umbp pool (``"pool"`` in the extra config):
:class:`PoolPages`, what :class:`umbp.sglang.UmbpHiCacheStorage` keeps instead of its
in-process tiers.

- **Blocks.** A HiCache page is one pool block per contiguous run of its bytes in SGLang's
  host pool (``page_first``: its K and its V; ``layer_first``: K and V of each layer), keyed
  by :func:`umbp.kvpool.pool_key` of the page hash and the run's number under a namespace
  naming the shape (model, host layout, dtype, page tokens and bytes, runs, tensor- and
  pipeline-parallel rank and size; ``pool_namespace`` is mixed in), so instances of other
  models or shapes never hit each other's blocks. A page is a hit when every run is.
- **Tiers.** This rank is one node of the pool. Its saves go to its SSD file when it has one
  (tier 1, durable: kept across restarts with an embedded index, readable by the other
  instances on the host, which find it in the node's announcement), else to its DRAM arena
  (tier 0, read by this process only). The pool evicts (least recently used, between
  watermarks) instead of the in-process DRAM-to-SSD demotion.
- **Memory nodes** (a Redis pool and the nodes' secret): their blocks are hits, reached
  through the engine's remote tier; ``pool_save_to`` sends saves to them.
- **Moves.** Saves are :meth:`umbp.Pool.put` (reserve, one transfer batch, publish with each
  block's CRC32C); loads of this node's and memory nodes' blocks are :meth:`umbp.Pool.get`
  (lookup, lease, one verified transfer batch, release); a block in another instance's SSD
  file is leased, read from that file with its CRC32C verified, and released here.
- **Faults** cost keys, never bytes: an index that cannot be reached is a miss for a lookup
  and a failed key for a save or load; a block whose bytes do not match its checksum fails
  its key and leaves the pool.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import Engine, Object, Range, Registration
from ..kvpool import SAVE_LOCAL, SAVE_MEMORY_NODES_ONLY, _instance, pool_key
from ..pool import Pool
from ..poolkeys import PoolKeys, default_node, open_index

__all__ = ["PoolPages", "DRAM_TIER", "SSD_TIER", "WHERE"]

logger = logging.getLogger("umbp.sglang")

#: This node's tiers in the pool: the DRAM arena and the SSD file.
DRAM_TIER = 0
SSD_TIER = 1

#: Where saved blocks went (:attr:`PoolPages.stored`): this node's DRAM arena or SSD file, a
#: memory node; ``"present"``: the pool held the block already.
WHERE = ("dram", "ssd", "memory_node", "present")

#: Objects move in pages of at most this much (the SSD engine's largest fragment).
_TIER_PAGE = 1 << 20


def split(ranges: Sequence[Range], parts: Sequence[int]) -> Optional[List[Tuple[Registration, int, int]]]:
    """Each of a page's runs (lengths ``parts``, in page order) as ``(registration, offset,
    length)`` in the memory ``ranges`` (a page's ranges, offsets within the page) lay it out
    in; None when a run does not lie in one range (a layout the runs were not cut from)."""
    out = []
    at = 0
    for length in parts:
        for r in ranges:
            if r.offset <= at and at + length <= r.offset + r.length:
                if not isinstance(r.endpoint, Registration):
                    return None
                out.append((r.endpoint, r.endpoint_offset + at - r.offset, length))
                break
        else:
            return None
        at += length
    return out


class PoolPages:
    """A backend's pages in the pool ``cfg.pool`` names (see the module). ``engine``: the
    backend's engine (made with ``cfg``'s checksum policy and remote options); ``parts``: the
    lengths of a page's runs; ``namespace``: bytes naming the shape; ``rank``: this rank's
    index among the instance's ranks (its node is ``pool_node + rank``); ``ssd_file``: this
    rank's SSD file, or None; ``pool_file``: the embedded index's file, or None for Redis.

    Thread-safe: SGLang's prefetch and backup threads call at once."""

    def __init__(
        self,
        cfg: Any,
        engine: Engine,
        *,
        parts: Sequence[int],
        namespace: bytes,
        rank: int,
        ssd_file: Optional[str],
        pool_file: Optional[str],
        ssd_direct: bool = True,
        load_timeout_s: Optional[float] = None,
    ):
        keys: PoolKeys = cfg
        assert keys.pool is not None
        self.keys = keys
        self.engine = engine
        self.parts = list(parts)
        self.namespace = namespace
        self.load_timeout_s = load_timeout_s
        self.ssd_direct = ssd_direct
        #: A slot holds the longest run, rounded up for O_DIRECT.
        self.slot_bytes = -(-max(self.parts) // 4096) * 4096
        self.host = socket.gethostname()
        self.memory_nodes = keys.memory_nodes()
        self.ssd_file = os.path.abspath(ssd_file) if ssd_file else None
        self.tier = SSD_TIER if self.ssd_file else DRAM_TIER
        size = int(cfg.ssd_bytes) if self.ssd_file else int(cfg.dram_bytes)
        self.slots = size // self.slot_bytes
        if self.slots == 0 and keys.pool_save_to != SAVE_MEMORY_NODES_ONLY:
            raise ValueError(
                f"umbp.sglang: {'ssd_bytes' if self.ssd_file else 'dram_bytes'} holds no block "
                f"of {self.slot_bytes} bytes"
            )
        self.node = (
            keys.pool_node + rank
            if keys.pool_node is not None
            else default_node([self.ssd_file] if self.ssd_file else [], f"sglang{rank}")
        )
        target = keys.pool if pool_file is None else os.path.abspath(pool_file)
        if pool_file is not None:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        self.index = open_index(target, keys.seal_secret())
        #: Saved blocks per destination (:data:`WHERE`), and loads per outcome.
        self.stored: Dict[str, int] = {w: 0 for w in WHERE}
        self.loaded: Dict[str, int] = {"own": 0, "memory_node": 0, "peer_file": 0, "failed": 0}
        self._lock = threading.Lock()
        self._nodes: Dict[int, Tuple[str, Optional[Dict[str, Any]], List[Tuple[int, int]]]] = {}
        self._nodes_at = 0.0
        self._specs: Dict[Tuple[int, int], Optional[Tuple[int, int]]] = {}
        self._files: Dict[Tuple[str, int], Registration] = {}
        self._tier_reg: Optional[Registration] = None
        self._arena: Optional[np.ndarray] = None
        self.reconciled: Optional[Any] = None
        if self.slots:
            self._open_tier(cfg)
        self.pool = Pool(
            engine,
            self.index,
            node=self.node,
            address=self._address(),
            reservation_ttl=float(keys.pool_reserve_s),
            lease_ttl=float(keys.pool_lease_s),
            announce_ttl=float(keys.pool_announce_s),
        )
        if self._tier_reg is not None:
            self.pool.add_tier(
                self.tier,
                self._tier_reg,
                slot_size=self.slot_bytes,
                slot_count=self.slots,
                durable=self.tier == SSD_TIER,
            )
        logger.info(
            "umbp.sglang: pool %s, node %d, %d %s slots of %d bytes, saves to %s%s",
            keys.pool if pool_file is None else target,
            self.node,
            self.slots,
            "SSD" if self.ssd_file else "DRAM",
            self.slot_bytes,
            keys.pool_save_to,
            ", reads memory nodes" if self.memory_nodes else "",
        )

    # -- set-up --------------------------------------------------------------------------

    def _open_tier(self, cfg: Any) -> None:
        """Opens this node's tier; an embedded index is first reconciled with the SSD file
        (the blocks whose bytes cannot be what was published are dropped: misses)."""
        size = self.slots * self.slot_bytes
        if self.ssd_file is None:
            self._arena = np.zeros(size, dtype=np.uint8)
            self._tier_reg = self.engine.register(self._arena)
            return
        from . import open_locked_file

        self._tier_reg = open_locked_file(self.engine, self.ssd_file, size, self.ssd_direct)
        if self.index.embedded:
            files = [(self.node, SSD_TIER, self.slot_bytes, self.slots, self.ssd_file, 0)]
            self.reconciled = self.index.reconcile(files, "sample")
            dropped = self.reconciled.dropped
            (logger.warning if dropped else logger.info)(
                "umbp.sglang: the embedded pool and %s: %d block(s) kept, %d dropped%s",
                self.ssd_file,
                self.reconciled.kept,
                len(dropped),
                f" (first: {dropped[0][1]} {dropped[0][2]})" if dropped else "",
            )

    def _address(self) -> str:
        """This node's announcement: its host and SSD file, for the instances of the host."""
        files = {}
        if self.ssd_file is not None:
            files[str(SSD_TIER)] = [self.ssd_file, self.slots * self.slot_bytes]
        return json.dumps({"umbp": "sglang", "host": self.host, "files": files}, sort_keys=True)

    # -- who can be read -----------------------------------------------------------------

    def pool_keys(self, key: str) -> List[bytes]:
        """The pool keys of page ``key``'s runs."""
        raw = key.encode()
        return [pool_key(self.namespace, raw, j) for j in range(len(self.parts))]

    def _look(self, *, force: bool = False) -> None:
        """Refreshes the view of the nodes alive (at most once a second unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._nodes_at < 1.0:
            return
        self._nodes_at = now
        try:
            nodes = self.index.nodes()
        except Exception as e:
            logger.warning("umbp.sglang: reading the pool's nodes failed: %s", e)
            return
        with self._lock:
            self._nodes = {int(n): (a, _instance(a), list(t)) for n, a, t in nodes}

    def _spec(self, node: int, tier: int) -> Optional[Tuple[int, int]]:
        """(slot size, slot count) of another node's tier, or None."""
        if (node, tier) not in self._specs:
            try:
                spec = self.index.tier_spec(node, tier)
            except Exception:
                return None
            self._specs[(node, tier)] = None if spec is None else (int(spec[0]), int(spec[1]))
        return self._specs[(node, tier)]

    def _route(self, p: Any) -> Optional[str]:
        """How placement ``p`` is read: ``"own"`` (this node's tier), ``"memory_node"``,
        ``"peer_file"`` (another instance's SSD file on this host), or None (unreachable)."""
        node, tier = int(p.node), int(p.tier)
        if node == self.node:
            return "own" if tier == self.tier and self._tier_reg is not None else None
        if node not in self._nodes:
            self._look()
        entry = self._nodes.get(node)
        if entry is None:
            return None
        address, info, _ = entry
        if info is None:
            return "memory_node" if self.memory_nodes and ":" in address else None
        if info.get("host") != self.host:
            return None
        files = info.get("files")
        if isinstance(files, dict) and str(tier) in files:
            return "peer_file"
        return None

    def _peer_file(self, p: Any) -> Optional[Tuple[str, int]]:
        entry = self._nodes.get(int(p.node))
        if entry is None or entry[1] is None:
            return None
        try:
            path, size = entry[1]["files"][str(int(p.tier))]
            return str(path), int(size)
        except (KeyError, TypeError, ValueError):
            return None

    # -- SGLang's calls ------------------------------------------------------------------

    def prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, can be loaded now: every run published on a
        tier this rank reads (one lookup)."""
        if not keys:
            return 0
        n = len(self.parts)
        try:
            found = self.index.lookup([k for key in keys for k in self.pool_keys(key)])
        except Exception as e:
            logger.warning("umbp.sglang: a pool lookup failed (a miss): %s", e)
            return 0
        hits = 0
        for i in range(len(keys)):
            ps = found[i * n : (i + 1) * n]
            if any(p is None or self._route(p) is None for p in ps):
                break
            hits += 1
        return hits

    def save(self, keys: Sequence[str], pages: Sequence[Optional[Sequence[Range]]]) -> List[bool]:
        """Saves each key's page from its memory ranges (``pages[i]``; None: that key fails);
        one bool per key, True also where the pool held it already."""
        blocks: List[Tuple[int, Tuple[bytes, Registration, int, int]]] = []
        ok = [False] * len(keys)
        for i, (key, ranges) in enumerate(zip(keys, pages)):
            runs = split(ranges, self.parts) if ranges is not None else None
            if runs is None:
                continue
            ok[i] = True
            blocks += [(i, (k, reg, off, ln)) for k, (reg, off, ln) in zip(self.pool_keys(key), runs)]
        if not blocks:
            return ok
        done = [False] * len(blocks)
        left = list(range(len(blocks)))
        if self.keys.pool_save_to != SAVE_LOCAL:
            left = self._save_to_memory_nodes(blocks, done, left)
            if left and (self.keys.pool_save_to == SAVE_MEMORY_NODES_ONLY or not self.slots):
                left = []  # no memory node had room: those keys fail
        if left:
            self._put(self.tier, None, blocks, left, done)
        for (i, _), d in zip(blocks, done):
            ok[i] = ok[i] and d
        return ok

    def _put(
        self,
        tier: int,
        node: Optional[int],
        blocks: List[Tuple[int, Tuple[bytes, Registration, int, int]]],
        which: List[int],
        done: List[bool],
    ) -> List[int]:
        """Puts blocks ``which`` into ``tier`` of ``node`` (None: this one); marks ``done``;
        returns those that failed."""
        try:
            results = self.pool.put(tier, [blocks[j][1] for j in which], node=node)
        except Exception as e:
            logger.warning("umbp.sglang: a pool put failed (those keys are not saved): %s", e)
            return which
        failed = []
        for j, r in zip(which, results):
            if r.ok:
                done[j] = True
                where = (
                    "present"
                    if r.status == "present"
                    else "memory_node"
                    if node is not None
                    else ("ssd" if tier == SSD_TIER else "dram")
                )
                self._count(self.stored, where)
            else:
                failed.append(j)
                logger.debug("umbp.sglang: a block's save failed: %s", r.error)
        return failed

    def _save_to_memory_nodes(
        self,
        blocks: List[Tuple[int, Tuple[bytes, Registration, int, int]]],
        done: List[bool],
        left: List[int],
    ) -> List[int]:
        """Spreads blocks ``left`` over the memory nodes' tiers by free bytes (each page's runs
        together, to the tier with the most left after the pages before it); returns those no
        tier took."""
        self._look(force=True)
        targets = []
        for node, (address, info, tiers) in sorted(self._nodes.items()):
            if info is not None or node == self.node or ":" not in address:
                continue
            for tier, free in tiers:
                spec = self._spec(node, int(tier))
                if spec is not None and spec[0] >= max(self.parts):
                    targets.append([int(free), node, int(tier)])
        if not targets:
            return left
        spread: Dict[Tuple[int, int], List[int]] = {}
        page_bytes = sum(self.parts)
        by_key: Dict[int, List[int]] = {}
        for j in left:
            by_key.setdefault(blocks[j][0], []).append(j)
        for js in by_key.values():
            t = max(targets, key=lambda x: x[0])
            t[0] -= page_bytes
            spread.setdefault((t[1], t[2]), []).extend(js)
        failed: List[int] = []
        for (node, tier), js in spread.items():
            failed += self._put(tier, node, blocks, js, done)
        return failed

    def load(self, keys: Sequence[str], pages: Sequence[Optional[Sequence[Range]]]) -> List[bool]:
        """Loads each key's page into its memory ranges (``pages[i]``); one bool per key
        (False: not in the pool, unreachable, or its load failed or did not verify)."""
        n = len(self.parts)
        ok = [False] * len(keys)
        wanted: List[Tuple[int, bytes, Registration, int, int]] = []
        for i, (key, ranges) in enumerate(zip(keys, pages)):
            runs = split(ranges, self.parts) if ranges is not None else None
            if runs is not None:
                wanted += [(i, k, reg, off, ln) for k, (reg, off, ln) in zip(self.pool_keys(key), runs)]
        if not wanted:
            return ok
        try:
            found = self.index.lookup([w[1] for w in wanted])
        except Exception as e:
            logger.warning("umbp.sglang: a pool lookup failed (misses): %s", e)
            return ok
        # A key moves only where every run is found and reachable: a miss leaves its page.
        routes: Dict[int, List[Tuple[int, Any, str]]] = {}
        for j, (w, p) in enumerate(zip(wanted, found)):
            route = self._route(p) if p is not None else None
            routes.setdefault(w[0], []).append((j, p, route or ""))
        pool_get: List[int] = []
        peer: List[Tuple[int, Any]] = []
        for i, rs in routes.items():
            if len(rs) != n or any(not r for _, _, r in rs):
                continue
            for j, p, r in rs:
                if r == "peer_file":
                    peer.append((j, p))
                else:
                    pool_get.append(j)
        loaded = [False] * len(wanted)
        if pool_get:
            try:
                got = self.pool.get([wanted[j][1:] for j in pool_get])
            except Exception as e:
                logger.warning("umbp.sglang: a pool get failed (those keys miss): %s", e)
                got = []
            for j, res in zip(pool_get, got):
                loaded[j] = res.ok
                if res.ok and res.placement is not None:
                    self._count(self.loaded, "own" if res.placement.node == self.node else "memory_node")
                elif res.status == "failed":
                    self._count(self.loaded, "failed")
                    logger.warning("umbp.sglang: a block's load failed: %s", res.error)
        if peer:
            self._load_peer(wanted, peer, loaded)
        for i, rs in routes.items():
            ok[i] = len(rs) == n and all(loaded[j] for j, _, _ in rs)
        return ok

    def _load_peer(
        self,
        wanted: List[Tuple[int, bytes, Registration, int, int]],
        peer: List[Tuple[int, Any]],
        loaded: List[bool],
    ) -> None:
        """Loads blocks from other instances' SSD files: leased, read with their CRC32C
        verified, released; a block that failed leaves the pool."""
        try:
            lease, granted = self.index.lease([p for _, p in peer], float(self.keys.pool_lease_s))
        except Exception as e:
            logger.warning("umbp.sglang: a pool lease failed (those keys miss): %s", e)
            return
        try:
            objects: List[Object] = []
            tags: List[int] = []
            for (j, p), g in zip(peer, granted):
                where = self._peer_file(p) if g else None
                reg = self._file(*where) if where is not None else None
                if reg is None:
                    continue
                length = int(p.length)
                page = min(length, _TIER_PAGE)
                base = int(p.slot) * self.slot_bytes
                offsets = np.arange(-(-length // page), dtype=np.uint64) * np.uint64(page)
                _, _, dst, off, cap = wanted[j]
                if length > cap:
                    continue
                objects.append(
                    Object(
                        len(tags),
                        reg,
                        offsets + np.uint64(base),
                        page,
                        length,
                        [Range(0, length, dst, off)],
                        int(p.checksum),
                    )
                )
                tags.append(j)
            if objects:
                report = self.engine.restore(objects, timeout=self.load_timeout_s)
                bad = []
                for o in report.objects:
                    j = tags[o.tag]
                    loaded[j] = bool(o.ok)
                    if o.ok:
                        self._count(self.loaded, "peer_file")
                    else:
                        self._count(self.loaded, "failed")
                        bad.append(wanted[j][1])
                        logger.warning("umbp.sglang: a block's load failed: %s", o.error)
                if bad:
                    self._remove_after(lease, bad)
                    lease = 0
        except Exception as e:
            logger.warning("umbp.sglang: a load from another instance's file failed: %s", e)
        finally:
            if lease:
                self._release(lease)

    def _remove_after(self, lease: int, keys: List[bytes]) -> None:
        """Releases ``lease``, then removes ``keys`` (blocks whose bytes are not trusted)."""
        self._release(lease)
        try:
            self.index.remove(keys)
        except Exception as e:
            logger.warning("umbp.sglang: removing blocks whose load failed failed: %s", e)

    def _release(self, lease: int) -> None:
        try:
            self.index.release(lease)
        except Exception as e:  # it expires by itself
            logger.warning("umbp.sglang: releasing a lease failed: %s", e)

    def _file(self, path: str, size: int) -> Optional[Registration]:
        """Another instance's SSD file, registered read-only once."""
        with self._lock:
            reg = self._files.get((path, size))
            if reg is None:
                try:
                    reg = self.engine.register_file(
                        path, 0, size, direct=self.ssd_direct, writable=False
                    )
                except Exception as e:
                    logger.warning("umbp.sglang: cannot open %s: %s", path, e)
                    return None
                self._files[(path, size)] = reg
            return reg

    def _count(self, counters: Dict[str, int], name: str) -> None:
        with self._lock:  # SGLang's threads save and load at once
            counters[name] += 1

    def counters(self) -> Dict[str, Any]:
        """What this rank's pool did: ``stored`` blocks per destination, ``loaded`` blocks
        per source (and ``failed``), and the pool's own counters."""
        with self._lock:
            stored, loaded = dict(self.stored), dict(self.loaded)
        return {"stored": stored, "loaded": loaded, "pool": self.pool.metrics()}

    def close(self) -> None:
        """Stops announcing this node and lets go of its tier and the files it read. A Redis
        pool is left at once (other instances miss this node's blocks instead of failing
        them); an embedded one keeps the node's blocks for the next start."""
        if not self.index.embedded:
            try:
                self.pool.leave()
            except Exception as e:
                logger.warning("umbp.sglang: leaving the pool failed: %s", e)
        self.pool.close()
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for reg in files:
            reg.close()
        if self._tier_reg is not None:
            self._tier_reg.close()
            self._tier_reg = None
