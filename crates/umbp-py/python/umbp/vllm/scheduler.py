"""The connector's scheduler side: the index (in-process, or a pool's) and the
per-request bookkeeping that plans each step's loads, saves and demotions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..kvpool import REMOTE, PoolTierIndex
from ..kvtiers import DRAM, TierIndex
from ..poolkeys import default_node, open_index
from .config import UmbpConfig, _dp_rank
from .layout import _Layout
from .metadata import Item, UmbpConnectorMetadata, UmbpWorkerMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _pool_namespace(
    cfg: UmbpConfig, vllm_config: "VllmConfig", layout: _Layout, ranks: int
) -> bytes:
    """What makes the bytes of one block hash differ between instances sharing a pool: the
    model (or ``pool_namespace``, which names it instead) and the KV cache's shape and
    placement (dtype, layout, block size, page bytes, layers, TP size). Keys of instances
    that differ in any of them never meet."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    fields: Dict[str, Any] = {
        "umbp.vllm": 1,
        "model": cfg.pool_namespace
        or [str(getattr(model, "model", "")), str(getattr(model, "revision", None))],
        "dtype": [str(getattr(model, "dtype", "")), str(getattr(cache, "cache_dtype", ""))],
        "layout": str(getattr(cache, "kv_cache_layout", None)),
        "block_size": layout.block_size,
        "page_bytes": layout.page_bytes,
        "layers": list(layout.layer_names),
        "tp": ranks,
    }
    if layout.groups:
        # Several KV cache groups: each group's layers and window name its blocks too.
        fields["groups"] = [[list(g.layer_names), g.window, g.retained] for g in layout.groups]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()


def _open_pool(
    cfg: UmbpConfig, vllm_config: "VllmConfig", layout: _Layout, ranks: int
) -> Optional[PoolTierIndex]:
    """The scheduler's index over the pool ``cfg.pool`` names, None without one. Only the
    scheduler opens it (the embedded index's file can be opened by one process): workers move
    bytes where the metadata says."""
    if cfg.pool is None:
        return None
    dp = _dp_rank(vllm_config)
    target = cfg.pool
    if "://" not in target:
        target = os.path.abspath(cfg.pool_file(dp) or target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
    ssd_files = [
        os.path.abspath(f) for f in (cfg.ssd_file(r, ranks, dp) for r in range(ranks)) if f
    ]
    node = cfg.pool_node
    if node is None:
        node = default_node(ssd_files, str(dp))
    slot = layout.slot_bytes
    client = open_index(target, cfg.seal_secret())
    index = PoolTierIndex(
        client,
        node=node,
        ranks=ranks,
        slot_bytes=slot,
        object_bytes=layout.object_bytes,
        dram_slots=cfg.dram_bytes_per_rank // slot,
        ssd_slots=cfg.ssd_bytes_per_rank // slot if cfg.ssd_path else 0,
        ssd_files=ssd_files,
        namespace=_pool_namespace(cfg, vllm_config, layout, ranks),
        lease_s=cfg.pool_lease_s,
        reserve_s=cfg.pool_reserve_s,
        announce_s=cfg.pool_announce_s,
        memory_nodes=cfg.memory_nodes(),
        save_to=cfg.pool_save_to,
    )
    index.start()
    logger.info(
        "UmbpConnector: pool %s, node %d, %s tier, saves to %s%s",
        cfg.pool if "://" in cfg.pool else target,
        node,
        index.tier,
        cfg.pool_save_to,
        ", reads memory nodes" if index.memory_nodes else "",
    )
    return index


def _hit_source(tier: str) -> CacheHitSource:
    """How vLLM's prefix-cache metrics name a hit in ``tier``: DRAM is host memory, SSD is
    disk, and a pool's memory node is a remote store (vLLM has no name of its own for it)."""
    if tier == DRAM:
        return CacheHitSource.HOST
    return CacheHitSource.EXTERNAL_UNSPECIFIED if tier == REMOTE else CacheHitSource.DISK


class _SchedulerSide:
    """The index and the per-request bookkeeping (see :class:`UmbpConnector`)."""

    def __init__(
        self,
        cfg: UmbpConfig,
        layout: _Layout,
        ranks: int,
        pool: Optional[PoolTierIndex] = None,
        *,
        loads: bool = True,
        saves: bool = True,
    ):
        self.cfg = cfg
        self.layout = layout
        dram_slots = cfg.dram_bytes_per_rank // layout.slot_bytes
        ssd_slots = cfg.ssd_bytes_per_rank // layout.slot_bytes if cfg.ssd_path else 0
        #: The pool's index, when one is configured: it replaces the in-process one.
        self.pool = pool
        #: kv_role: a kv_producer never loads, a kv_consumer never saves.
        self.loads, self.saves = loads, saves
        self.index: "TierIndex | PoolTierIndex" = (
            pool
            if pool is not None
            else TierIndex(
                dram_slots,
                ssd_slots,
                ranks=ranks,
                dram_free_slots=math.ceil(cfg.dram_free_fraction * dram_slots),
            )
        )
        self.kv_cache_manager = None
        self._requests: Dict[str, "Request"] = {}
        self._next_save: Dict[str, int] = {}  # request -> first block not yet planned
        self._save_ops: Dict[str, Set[int]] = {}  # request -> its save operations
        self._save_block: Dict[int, int] = {}  # save operation -> its block's index
        # request -> its GPU blocks per KV cache group, last step it ran
        self._blocks: Dict[str, List[List[int]]] = {}
        self._plans: Dict[str, Tuple[int, int]] = {}  # request -> (first block, blocks) hit
        self._pending_loads: Dict[str, List[Item]] = {}
        #: Operations of this step on a KV cache group other than 0 (-> the group).
        self._pending_groups: Dict[int, int] = {}
        self._hit_sources: Dict[str, Dict[CacheHitSource, int]] = {}
        self._loading: Set[str] = set()  # async loads not yet reported finished
        self._hold: List[str] = []
        # KV events (enable_events): what each stored block's BlockStored says, kept while
        # it is stored or being saved; the save operations whose key may need forgetting.
        self._events: Optional[List["KVCacheEvent"]] = None
        self._event_meta: Dict[Any, "BlockStored"] = {}
        self._event_ops: Dict[int, Any] = {}
        logger.info(
            "UmbpConnector: %d layers x %d bytes per block and rank, slots: %d DRAM, %d SSD, load %s",
            len(layout.layer_names),
            layout.page_bytes,
            dram_slots,
            ssd_slots,
            cfg.load_mode,
        )

    # -- KV events -------------------------------------------------------------------------

    def enable_events(self) -> None:
        """Publishes vLLM KV events (``BlockStored``, ``BlockRemoved``) for what the tiers
        hold: a block is stored once every rank's save of it landed (medium ``"CPU"`` for
        DRAM, ``"STORAGE"`` for SSD), moves from CPU to STORAGE when demoted, and is removed
        when evicted, dropped after a failed load or cleared by a reset."""
        self._events = []
        self.index.on_residency = self._residency

    def _key(self, request: "Request", group: int, i: int) -> Any:
        """The index key of block ``i`` of ``request`` in KV cache group ``group``: vLLM's
        block hash in group 0 (so a model with one group keeps its keys), (group, hash) in
        the others."""
        h = request.block_hashes[i]
        return h if group == 0 else (group, h)

    @property
    def _source_group(self) -> int:
        """The group whose loads say where a hit's tokens come from (vLLM's hit-source
        metrics): the first full-attention one, which loads a block per hit token block."""
        return next((g for g, lay in enumerate(self.layout.all_groups) if lay.window is None), 0)

    @property
    def _null(self) -> int:
        """vLLM's null block: what a sliding-window group's freed blocks read as."""
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        return int(pool.null_block.block_id) if pool is not None else 0

    def _record_store(self, request: "Request", i: int, op: int, group: int = 0) -> None:
        """What the event of block ``i`` of ``request`` (in KV cache group ``group``) will
        say once its save (``op``) landed, built as vLLM's own block pool builds its
        ``BlockStored``."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        bs = self.layout.block_size
        key = self._key(request, group, i)
        extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
        lora = request.lora_request
        self._event_meta[key] = BlockStored(
            block_hashes=[maybe_convert_block_hash(request.block_hashes[i])],
            parent_block_hash=maybe_convert_block_hash(request.block_hashes[i - 1]) if i else None,
            token_ids=list(request.all_token_ids[i * bs : (i + 1) * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys([extra]),
            group_idx=group,
            session_id=getattr(request, "session_id", None),
        )
        self._event_ops[op] = key

    def _residency(self, key: Any, tier: str, stored: bool) -> None:
        import msgspec
        from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        if self._events is None:
            return
        medium = MEDIUM_CPU if tier == DRAM else MEDIUM_STORAGE
        meta = self._event_meta.get(key)
        if stored:
            if meta is not None:
                self._events.append(msgspec.structs.replace(meta, medium=medium))
            return
        group, h = key if isinstance(key, tuple) else (0, key)
        hashes = meta.block_hashes if meta is not None else [maybe_convert_block_hash(h)]
        self._events.append(
            BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)
        )
        if self.index.entry(key) is None:
            self._event_meta.pop(key, None)

    def _settled_event_op(self, op: int) -> None:
        """A save settled: a block it never stored (failed) needs no event data."""
        key = self._event_ops.pop(op, None)
        if key is not None and self.index.entry(key) is None:
            self._event_meta.pop(key, None)

    def take_events(self) -> List["KVCacheEvent"]:
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    def matched(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        bs = self.layout.block_size
        rid = request.request_id
        self._plans.pop(rid, None)
        if num_computed_tokens % bs or not self.loads:
            return 0, False
        start = num_computed_tokens // bs
        # vLLM computes at least the last prompt token itself.
        most = (request.num_tokens - 1) // bs - start
        if most <= 0:
            return 0, False
        if self.layout.groups:
            n = self._hit_all_groups(request, start, most)
        else:
            n = self.index.count_hits(request.block_hashes[start : start + most])
        if n == 0:
            return 0, False
        self._plans[rid] = (start, n)
        return n * bs, self.cfg.load_mode == "async"

    def _hit_all_groups(self, request: "Request", start: int, n: int) -> int:
        """With several KV cache groups: how many of the ``n`` blocks from block ``start``
        every group can restore. A full-attention group needs each of them; a sliding-window
        group only those it keeps at the hit's end (the blocks of the window before it; vLLM
        frees the others). A block missing in any group cuts the hit before it. (vLLM may
        order a sliding-window group first: no group is special.)"""
        groups = self.layout.groups
        for g, lay in enumerate(groups):
            if lay.window is None:
                keys = [self._key(request, g, i) for i in range(start, start + n)]
                n = self.index.count_hits(keys)
        changed = True
        while n > 0 and changed:
            changed = False
            for g, lay in enumerate(groups):
                if lay.window is None:
                    continue
                end = start + n
                lo = max(start, lay.first_kept(end * lay.block_size))
                # From the window's end backwards: its last missing block (one lookup).
                keys = [self._key(request, g, i) for i in range(end - 1, lo - 1, -1)]
                present = self.index.count_hits(keys)
                if present < len(keys):
                    n, changed = end - 1 - present - start, True
                    if n <= 0:
                        return 0
        return n

    def after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self._requests[rid] = request
        self._next_save.setdefault(rid, 0)
        plan = self._plans.pop(rid, None)
        if num_external_tokens <= 0 or plan is None:
            return
        start, n = plan
        n = min(n, num_external_tokens // self.layout.block_size)
        items: List[Item] = []
        sources: Dict[CacheHitSource, int] = {}
        hybrid = bool(self.layout.groups)
        null = self._null
        for g, block_ids in enumerate(blocks.get_block_ids()[: len(self.layout.all_groups)]):
            for i in range(start, min(start + n, len(block_ids))):
                if hybrid and block_ids[i] == null:
                    continue  # below a sliding window's end: vLLM keeps no block for it
                # (A pool's begin_load of a block gone since the lookup is a failing load.)
                key = self._key(request, g, i)
                if hybrid and isinstance(self.index, TierIndex) and not self.index.is_hit(key):
                    # vLLM took less than the hit, and this window lacks a block: it fails
                    # alone, and vLLM recomputes from it.
                    items.append((0, DRAM, -1, block_ids[i]))
                    continue
                op, tier, slot = self.index.begin_load(key)
                items.append((op, tier, slot, block_ids[i]))
                if g:
                    self._pending_groups[op] = g
                if g != self._source_group:
                    continue
                source = _hit_source(tier)
                sources[source] = sources.get(source, 0) + self.layout.block_size
        self._pending_loads[rid] = items
        self._hit_sources[rid] = sources
        if self.cfg.load_mode == "async":
            self._loading.add(rid)

    def hit_sources(self, request: "Request", n: int) -> Dict[CacheHitSource, int]:
        sources = self._hit_sources.pop(request.request_id, None)
        if sources is None or sum(sources.values()) != n:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: n} if n else {}
        return sources

    def _plan_saves(self, rid: str, num_computed: int, num_scheduled: int) -> List[Item]:
        request = self._requests.get(rid)
        if request is None or self.kv_cache_manager is None or not self.saves:
            return []
        end = num_computed + num_scheduled
        if not self.cfg.save_decode:
            end = min(end, request.num_prompt_tokens)
        full = min(end // self.layout.block_size, len(request.block_hashes))
        first = self._next_save.get(rid, 0)
        if full <= first and rid not in self._blocks:
            return []
        # Its blocks as this step uses them (a preempted request's are new): a load failure
        # reported for this step is matched against them (_poison).
        groups = self.kv_cache_manager.get_block_ids(rid)[: len(self.layout.all_groups)]
        self._blocks[rid] = [list(ids) for ids in groups]
        if full <= first:
            return []
        items = []
        null = self._null if self.layout.groups else None
        for g, block_ids in enumerate(groups):
            for i in range(first, min(full, len(block_ids))):
                if block_ids[i] == null:
                    continue  # a sliding-window group freed it: only blocks present are saved
                planned = self.index.begin_save(self._key(request, g, i))
                if planned is not None:
                    op, tier, slot = planned
                    items.append((op, tier, slot, block_ids[i]))
                    self._save_ops.setdefault(rid, set()).add(op)
                    self._save_block[op] = i
                    if g:
                        self._pending_groups[op] = g
                    if self._events is not None:
                        self._record_store(request, i, op, g)
        self._next_save[rid] = full
        return items

    def build_meta(self, so: "SchedulerOutput") -> UmbpConnectorMetadata:
        meta = UmbpConnectorMetadata(layerwise=self.cfg.load_mode == "layerwise")
        meta.loads, self._pending_loads = self._pending_loads, {}
        for req in so.scheduled_new_reqs:
            items = self._plan_saves(
                req.req_id, req.num_computed_tokens, so.num_scheduled_tokens[req.req_id]
            )
            if items:
                meta.saves[req.req_id] = items
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            items = self._plan_saves(
                rid, cached.num_computed_tokens[i], so.num_scheduled_tokens[rid]
            )
            if items:
                meta.saves[rid] = items
        if self.pool is not None:
            self._commit_pool(meta)
        meta.demotions = self.index.plan_demotions()
        if self.layout.groups and isinstance(self.index, TierIndex):
            for op, _, _ in meta.demotions:
                key = self.index.op_key(op)
                if isinstance(key, tuple):
                    self._pending_groups[op] = key[0]
        meta.groups, self._pending_groups = self._pending_groups, {}
        meta.hold, self._hold = self._hold, []
        meta.preempted = sorted(so.preempted_req_ids or ())
        return meta

    def _commit_pool(self, meta: UmbpConnectorMetadata) -> None:
        """The pool's part of a step: one lease over its loads, one reservation per rank over
        its saves (``meta.pool``: what each rank does). A save that got no slot on some rank
        (the block is published already, the tier is full, the pool unreachable) is dropped
        from the step: a later miss at worst."""
        assert self.pool is not None
        meta.pool = self.pool.commit()
        for rid, items in list(meta.loads.items()):
            meta.loads[rid] = [(op, t, meta.pool[op][0][2], b) for op, t, _, b in items]
        for rid, items in list(meta.saves.items()):
            kept = []
            for op, _, _, block in items:
                refs = meta.pool.get(op)
                if refs is None:
                    self._save_block.pop(op, None)
                else:
                    # The tier the pool reserved it in: this instance's, or a memory node's.
                    kept.append((op, self.pool.tier_of(op), refs[0][2], block))
            if kept:
                meta.saves[rid] = kept
            else:
                del meta.saves[rid]

    def finished(self, request: "Request") -> Tuple[bool, Optional[Dict[str, Any]]]:
        rid = request.request_id
        for d in (self._requests, self._next_save, self._plans, self._hit_sources):
            d.pop(rid, None)
        if rid in self._loading:
            # Its load writes into its blocks: vLLM frees them once the workers report it
            # (finished_recving). Saves from before a preemption, if any, read blocks vLLM
            # already took back and waited for (handle_preemptions): nothing to hold.
            self._forget_saves(rid)
            return True, None
        ops = self._save_ops.get(rid, set())
        if any(not self.index.op_settled(op) for op in ops):
            self._hold.append(rid)
            return True, None
        self._forget_saves(rid)
        return False, None

    def _forget_saves(self, rid: str) -> None:
        for op in self._save_ops.pop(rid, ()):
            self._save_block.pop(op, None)
        self._blocks.pop(rid, None)

    def _poison(self, invalid: Set[int]) -> None:
        """Blocks whose load failed (``invalid``, GPU block ids, every rank's): a request
        whose blocks include one was computed over wrong KV from that block on, in the step
        that loaded it (a layer-wise load feeds the same step's forward pass) and in any step
        scheduled before vLLM learned of the failure. Its saves of blocks from the first
        failed one on fail whatever the ranks report (``TierIndex.fail_save``), so no block
        computed over a failed load is ever published; the saves start again from there, as
        vLLM recomputes from the first failed block (``kv_load_failure_policy:
        "recompute"``).

        Those blocks also leave vLLM's own prefix cache: under the recompute policy vLLM
        keeps them there for the requests it recomputes in place, and a request that found
        them there before that (the failed request aborted or preempted first, or not
        scheduled in the step after) would compute over them and save what it computed."""
        stale = set(invalid)
        null = self._null if self.layout.groups else None
        for rid, groups in self._blocks.items():
            # Every layer reads the layers below it, whatever their group: a failed block of
            # any group makes what was computed from its position on wrong in all of them.
            firsts = [
                next(i for i, b in enumerate(ids) if b in invalid)
                for ids in groups
                if not invalid.isdisjoint(ids)
            ]
            if not firsts:
                continue
            first = min(firsts)
            for ids in groups:
                stale.update(b for b in ids[first:] if b != null)
            for op in self._save_ops.get(rid, ()):
                if self._save_block.get(op, -1) >= first:
                    self.index.fail_save(op)
            if rid in self._next_save:
                self._next_save[rid] = min(self._next_save[rid], first)
        if self.kv_cache_manager is not None:
            # Blocks in use stay allocated; only their hashes go (what vLLM's own "fail"
            # policy does to them).
            self.kv_cache_manager.evict_blocks(stale)

    def update(self, output: "KVConnectorOutput") -> None:
        # Load failures first: a save computed over one may be reported in this output too
        # (the step's layer-wise load settles in the step that used it, so its failure is
        # never reported after the step's saves).
        if output.invalid_block_ids:
            self._poison(set(output.invalid_block_ids))
        meta = output.kv_connector_worker_meta
        if isinstance(meta, UmbpWorkerMetadata):
            for op in sorted(set(meta.ok) | set(meta.failed)):
                ok, failed = meta.ok.get(op, 0), meta.failed.get(op, 0)
                if self.pool is not None:
                    self.pool.report(op, ok=ok, failed=failed, checksums=meta.checksums.get(op))
                else:
                    self.index.report(op, ok=ok, failed=failed)
                if self.index.op_settled(op):
                    self._save_block.pop(op, None)
                    if self._events is not None:
                        self._settled_event_op(op)
        for rid in output.finished_recving or ():
            self._loading.discard(rid)
        for rid in output.finished_sending or ():
            self._forget_saves(rid)
        if self.pool is not None:
            # Publishes what every rank saved, aborts what failed: one call each.
            self.pool.flush()
