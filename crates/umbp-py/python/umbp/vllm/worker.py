"""The connector's worker side: each rank's tiers, its registrations of vLLM's KV cache, and
the umbp batches that move the blocks the metadata names (memory nodes' files included).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
from vllm.logger import init_logger

from .. import Engine, FailureKind, Object, Range, Registration, RegistrationError
from ..kvpool import REMOTE, RankRef, remote_ref
from ..kvtiers import DRAM, SSD
from .config import UmbpConfig
from .layout import _Layout
from .metadata import Item, UmbpConnectorMetadata, UmbpWorkerMetadata
from .stats import UmbpConnectorStats

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


#: Objects are paged in the tiers by at most this much: the SSD engine moves a fragment of
#: at most its maximum segment (1 MiB) at once.
TIER_PAGE = 1 << 20


def _dense_pages(t: torch.Tensor, num_blocks: int, page_bytes: int) -> bool:
    """Whether each block's page of the layer view ``t`` (blocks, or kernel blocks, first) is
    one contiguous run of ``page_bytes``: true of the block-compact layouts, where the block
    and layer axes are outermost, false where heads sit outside blocks."""
    es = t.element_size()
    if t.dim() == 0 or t.shape[0] % num_blocks:
        return False
    dims = [(t.shape[d], t.stride(d) * es) for d in range(1, t.dim()) if t.shape[d] > 1]
    ratio = t.shape[0] // num_blocks
    if ratio > 1:  # kernel blocks: a manager block is `ratio` of them, back to back
        dims.append((ratio, t.stride(0) * es))
    expect = es
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride != expect:
            return False
        expect = stride * size
    return expect == page_bytes


@dataclass
class _Run:
    """Consecutive layers of one layer group that lie back to back in one registration: one
    range per block. ``offset``: where block 0 of the first layer starts."""

    object_offset: int
    length: int
    registration: Any
    offset: int
    block_stride: int
    group: int


@dataclass
class _Transfer:
    """A batch in flight: tag ``k`` is ``items[k]`` of request ``requests[k]``."""

    batch: Any
    kind: str  # "load", "save", "demote"
    items: List[Item]
    requests: List[str]
    layerwise: bool = False
    #: Operation id -> its KV cache group, where not 0 (UmbpConnectorMetadata.groups).
    groups: Dict[int, int] = field(default_factory=dict)


class _WorkerSide:
    def __init__(
        self,
        cfg: UmbpConfig,
        layout: _Layout,
        rank: int,
        ranks: int,
        kv_cache_config: "KVCacheConfig",
        dp_rank: int = 0,
    ):
        self.cfg = cfg
        self.layout = layout
        self.rank = rank
        self.ranks = ranks
        self.dp_rank = dp_rank
        self.kv_cache_config = kv_cache_config
        self.engine: Optional[Engine] = None
        self.cuda = False
        self._registrations: List[Any] = []
        #: Each KV cache group's ranges of a block (one group without the hybrid allocator).
        self._runs: List[List[_Run]] = []
        self._kv_caches: Dict[str, torch.Tensor] = {}
        self._groups = layout.all_groups
        # umbp's layer groups follow the forward pass: with several KV cache groups, their
        # layers interleave (by the layer index in their names).
        order = list(layout.layer_names)
        if layout.groups:
            from vllm.model_executor.models.utils import extract_layer_index

            order = sorted(
                (n for g in layout.groups for n in g.layer_names),
                key=lambda n: (extract_layer_index(n), n),
            )
        self._group_of: Dict[str, int] = {
            name: i // cfg.layers_per_group for i, name in enumerate(order)
        }
        self.dram: Optional[Registration] = None
        self.ssd: Optional[Registration] = None
        self.ssd_path: Optional[str] = None
        self._arena: Optional[np.ndarray] = None
        self._transfers: List[_Transfer] = []
        self._step_load: Optional[_Transfer] = None
        #: Whether this step's saves started (reset when metadata is bound).
        self.saves_started = False
        self._req_saves: Dict[str, List[_Transfer]] = {}
        self._hold: Set[str] = set()
        self._load_errors: Set[int] = set()
        #: With several KV cache groups: requests a load of failed (vLLM takes failures back
        #: per request there, failed_recving), until reported.
        self._failed_requests: Set[str] = set()
        self._ok: Dict[int, int] = {}
        self._failed: Dict[int, int] = {}
        self._stats = UmbpConnectorStats()
        #: (tier, slot) -> the CRC32C this rank's last completed save into the slot reported
        #: (None where the engine's checksum policy leaves the tier unhashed): loads of the
        #: slot verify it, so a block whose bytes changed in the tier is a load error.
        self._checksums: Dict[Tuple[str, int], Optional[int]] = {}
        #: With a pool: the save operations in flight (their checksums go back to the
        #: scheduler, which publishes them), the checksums to report (operation -> this rank
        #: -> CRC32C), and other instances' SSD files opened for reading, by path.
        self._pool_saves: Set[int] = set()
        self._crcs: Dict[int, Dict[int, int]] = {}
        self._peer_files: Dict[str, Optional[Registration]] = {}
        #: Memory nodes (a pool with their secret): one connection per node address, with its
        #: tiers registered as used ((tier, bytes) -> registration); nodes whose connection
        #: failed, not tried again until then; the operations in flight through one (-> its
        #: address): a failure of one retires the connection, so the next use connects again
        #: (a node restarted at its address is reached anew).
        self._nodes: Dict[str, Tuple[Any, Dict[Tuple[int, int], Registration]]] = {}
        self._nodes_down: Dict[str, float] = {}
        #: Connections being made in the background (a step never waits on a node whose host
        #: vanished), and their outcomes (the peer, or why not) until a step picks them up.
        self._connecting: Dict[str, threading.Thread] = {}
        self._connected: Dict[str, Tuple[Any, Optional[BaseException]]] = {}
        self._connect_lock = threading.Lock()
        self._remote_ops: Dict[int, str] = {}
        #: Pooled operations made to fail on purpose (a lease refused, a file or memory node
        #: out of reach), with why: tags of the batch being built, and their operations until
        #: they settle.
        self._refused: Dict[int, str] = {}
        self._refused_ops: Dict[int, str] = {}
        # A slot is paged by TIER_PAGE (or one page, for a smaller block): page k of slot s
        # starts at s * slot_bytes + k * page.
        self._page = min(layout.object_bytes, TIER_PAGE)
        self._pages = np.arange(-(-layout.object_bytes // self._page), dtype=np.uint64) * self._page
        #: Each KV cache group's (page, page offsets in a slot) for its objects.
        self._paging = [self._paging_of(g.object_bytes) for g in self._groups]

    def _paging_of(self, size: int) -> Tuple[int, np.ndarray]:
        if size == self.layout.object_bytes:
            return self._page, self._pages
        page = min(size, TIER_PAGE)
        return page, np.arange(-(-size // page), dtype=np.uint64) * page

    # -- registration ------------------------------------------------------------------------

    def register(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        layout = self.layout
        names = [n for g in self._groups for n in g.layer_names]
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ValueError(f"UmbpConnector: no KV cache tensor for layers {missing[:4]}")
        tensors = [kv_caches[n] for n in layout.layer_names]
        device = tensors[0].device
        self.cuda = device.type == "cuda"
        if self.cuda:
            from .. import CUDA

            if not CUDA:
                raise RuntimeError(
                    "UmbpConnector: the KV cache is on CUDA but this umbp build has no CUDA "
                    "backend, which every build has unless pyproject.toml's maturin features were "
                    "overridden: reinstall it as docs/VLLM.md says (the wheel `bash .ci/wheel` "
                    "builds, or `pip install \"./crates/umbp-py[vllm]\"`)"
                )
        # Host tiers are pinned for this rank's GPU.
        self.engine = Engine(
            "cuda" if self.cuda else "sim",
            pin_device=(device.index or 0) if self.cuda else 0,
            workers=self.cfg.engine_workers,
            checksums=self.cfg.engine_checksums(),
            # A pool's memory nodes are reached through the remote tier (UCX).
            **self._remote_options(),
        )
        self._kv_caches = kv_caches
        self._register_kv()
        self._open_tiers()

    def _register_kv(self) -> None:
        """Registers the KV cache (``register_kv_caches``, and again after vLLM's sleep mode
        gave its memory back) and plans each block's ranges in it (per KV cache group)."""
        layout = self.layout
        named = [(n, self._kv_caches[n]) for g in self._groups for n in g.layer_names]
        device = named[0][1].device
        # vLLM allocates the layers' caches as views of shared backing allocations (with the
        # hybrid allocator, one layer of each KV cache group shares one): register each
        # allocation once (registrations must not overlap), address layers inside it.
        by_storage: Dict[int, Any] = {}
        # Each allocation is named in errors by the layers it holds.
        storage_layers: Dict[int, List[str]] = {}
        for name, t in named:
            storage_layers.setdefault(t.untyped_storage().data_ptr(), []).append(name)
        strides = self._block_strides()
        self._runs = []
        count = 0
        for lay in self._groups:
            pb = lay.page_bytes
            layers = []
            for name in lay.layer_names:
                t = self._kv_caches[name]
                storage = t.untyped_storage()
                base = storage.data_ptr()
                if base not in by_storage:
                    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                    flat.set_(storage)
                    names = storage_layers[base]
                    held = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
                    reg = self._eng().register(
                        flat, label=f"vllm kv cache {self._who()} layer {held}"
                    )
                    self._registrations.append(reg)
                    by_storage[base] = (reg, storage.nbytes())
                reg, nbytes = by_storage[base]
                offset = t.data_ptr() - base
                stride = strides.get(name)
                if stride is None:
                    if t.dim() == 0 or t.shape[0] != layout.num_blocks:
                        raise ValueError(
                            f"UmbpConnector: cannot tell the block stride of layer {name}"
                        )
                    stride = t.stride(0) * t.element_size()
                if not _dense_pages(t, layout.num_blocks, pb):
                    raise NotImplementedError(
                        f"UmbpConnector: layer {name}'s pages are not contiguous in this KV cache "
                        "layout; use a block-compact one (VLLM_KV_CACHE_LAYOUT=LBNHC, LBHNC, "
                        "BLNHC or BLHNC)"
                    )
                last = offset + (layout.num_blocks - 1) * stride + pb
                if offset < 0 or last > nbytes:
                    raise ValueError(
                        f"UmbpConnector: layer {name}'s blocks lie outside its allocation"
                    )
                layers.append((reg, offset, stride, self._group_of[name]))
            # Merge consecutive layers that lie back to back into one range per block.
            runs: List[_Run] = []
            for i, (reg, offset, stride, group) in enumerate(layers):
                prev = runs[-1] if runs else None
                if (
                    prev is not None
                    and prev.registration is reg
                    and prev.block_stride == stride
                    and prev.group == group
                    and prev.offset + prev.length == offset
                ):
                    prev.length += pb
                else:
                    runs.append(_Run(i * pb, pb, reg, offset, stride, group))
            self._runs.append(runs)
            count += len(runs)
        logger.info(
            "UmbpConnector rank %d: %d layers in %d ranges per block, %s device",
            self.rank,
            len(named),
            count,
            device.type,
        )

    def unregister_kv(self) -> None:
        """vLLM's sleep mode is about to give the KV cache's memory back: every transfer in
        flight reads or writes it (a save of a finished request, an async load), so each one
        finishes first (its outcome is reported by the next ``get_finished``, as usual), then
        the KV cache's registrations close. The tiers and what they hold stay. Idempotent."""
        if not self._registrations:
            return
        for t in self._transfers:
            t.batch.wait()
        for reg in self._registrations:
            reg.close()
        self._registrations = []
        self._runs = []

    def restore_kv(self) -> None:
        """After vLLM's sleep mode mapped the KV cache's memory back: registers it again.
        Idempotent."""
        if self._registrations or not self._kv_caches or self.engine is None:
            return
        self._register_kv()

    def _block_strides(self) -> Dict[str, int]:
        """Each layer's block stride in bytes, from vLLM's placement of the KV cache."""
        out = {}
        for t in getattr(self.kv_cache_config, "kv_cache_tensors", ()) or ():
            stride = getattr(t, "block_stride", None)
            if stride:
                for name in t.layers:
                    out[name] = int(stride)
        return out

    def _who(self) -> str:
        """This worker in registration labels: ``rank 0``, or ``dp 1 rank 0`` in a
        data-parallel replica other than the first."""
        return f"dp {self.dp_rank} rank {self.rank}" if self.dp_rank else f"rank {self.rank}"

    def _open_tiers(self) -> None:
        slot = self.layout.slot_bytes
        dram_slots = self.cfg.dram_bytes_per_rank // slot
        if self.cfg.pool is not None and self.cfg.ssd_path:
            dram_slots = 0  # a pool keeps blocks in the SSD tier: no DRAM arena to fill
        if dram_slots:
            self._arena = np.zeros(dram_slots * slot, dtype=np.uint8)
            self.dram = self._eng().register(self._arena, label=f"vllm dram tier {self._who()}")
        path = self.cfg.ssd_file(self.rank, self.ranks, self.dp_rank)
        if path:
            ssd_slots = self.cfg.ssd_bytes_per_rank // slot
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            try:
                # Exclusive: another instance's saves into this file would overwrite this
                # one's slots, and its loads would then serve them as hits.
                self.ssd = self._eng().register_file(
                    path,
                    0,
                    ssd_slots * slot,
                    direct=self.cfg.ssd_direct,
                    create=True,
                    extend=True,
                    exclusive=True,
                    label=f"vllm ssd tier {self._who()} ({path})",
                )
            except RegistrationError as e:
                if e.errno != errno.EWOULDBLOCK:
                    raise
                raise RuntimeError(
                    f"UmbpConnector: the SSD tier file {path} is in use by another instance "
                    "(another vLLM server, or a data-parallel replica, given the same "
                    "ssd_path): give each its own ssd_path, or put {dp_rank} in it"
                ) from e
            self.ssd_path = path

    # -- moving blocks -----------------------------------------------------------------------

    def _ranges(self, block_id: int, group: int = 0) -> List[Range]:
        """Where the object of GPU block ``block_id`` of KV cache group ``group`` lies in the
        KV cache: a range per run of its layers."""
        if not self._runs:
            raise RuntimeError(
                "UmbpConnector: the KV cache is not registered (vLLM's sleep mode released it "
                "and it was not restored)"
            )
        return [
            Range(
                r.object_offset,
                r.length,
                r.registration,
                r.offset + block_id * r.block_stride,
                r.group,
            )
            for r in self._runs[group]
        ]

    def _object(self, tag: int, tier: str, slot: int, block_id: int, group: int = 0) -> Object:
        ranges = self._ranges(block_id, group)
        reg = self._tier(tier)
        size = self._groups[group].object_bytes
        page, pages = self._paging[group]
        return Object(
            tag,
            reg,
            pages + slot * self.layout.slot_bytes,
            page,
            size,
            ranges,
            # What this rank's last save into the slot reported: a load verifies it (a save
            # ignores it).
            checksum=self._checksums.get((tier, slot)),
        )

    def _eng(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("UmbpConnector: register_kv_caches has not run on this worker")
        return self.engine

    def _tier(self, tier: str) -> Registration:
        if tier == REMOTE and self._registrations:
            # A placeholder: _pool_object puts the memory node's registration in its place.
            placeholder: Registration = self._registrations[0]
            return placeholder
        reg = self.dram if tier == DRAM else self.ssd
        if reg is None:
            raise ValueError(f"UmbpConnector: this worker has no {tier} tier")
        return reg

    def _stream(self) -> Any:
        return torch.cuda.current_stream() if self.cuda else None

    def _objects(self, items: List[Item], meta: UmbpConnectorMetadata) -> List[Object]:
        """The objects of ``items`` (tag ``k``: ``items[k]``), placed where the pool said for
        this rank when ``meta.pool`` names their operation."""
        self._refused = {}
        objects = [
            self._object(k, tier, slot, block, meta.groups.get(op, 0))
            if op not in meta.pool
            else self._pool_object(k, tier, block, meta.pool[op][self.rank], op)
            for k, (op, tier, slot, block) in enumerate(items)
        ]
        for k, (op, _, slot, block) in enumerate(items):
            group = meta.groups.get(op, 0)
            if group and op in meta.pool:
                # Several KV cache groups in a pool: every group's object has one size (checked
                # at start), so only where the block lies differs.
                objects[k] = replace(objects[k], ranges=self._ranges(block, group))
            if slot < 0 and op not in meta.pool:
                # A block the scheduler knows cannot be loaded (several KV cache groups): an
                # object past the end of the tier, which fails alone, as a load error.
                o = objects[k]
                objects[k] = replace(o, page_offsets=o.page_offsets + np.uint64(1 << 60))
        self._refused_ops.update((items[k][0], why) for k, why in self._refused.items())
        return objects

    def _pool_object(
        self, tag: int, tier: str, block: int, ref: RankRef, op: int = 0
    ) -> Object:
        """The object of this rank's part of a pooled operation (``op``): its slot in this
        rank's own tier, in another instance's SSD file (opened read-only) or in a memory
        node's tier, and the checksum the pool recorded. A part the scheduler could not lease
        (slot -1), or whose file or memory node cannot be reached, is an object past the end
        of the tier, which the engine rejects alone: a load error (or a failed save) like any
        other; vLLM recomputes a block whose load failed."""
        path, size, slot, checksum = ref
        remote = remote_ref(path) if path else None
        own = SSD if self.ssd is not None else DRAM if self.dram is not None else REMOTE
        obj = self._object(tag, own, max(slot, 0), block)
        reg: Any
        if remote is not None:
            address, node_tier, slot_size = remote
            reg = self._remote_tier(address, node_tier, size)
            if reg is not None and slot >= 0:
                self._remote_ops[op] = address
                offsets = self._pages + np.uint64(slot * slot_size)
                return replace(obj, tier=reg, page_offsets=offsets, checksum=checksum)
        else:
            reg = self._peer_file(path, size) if path else obj.tier
        if slot < 0 or reg is None:
            self._refused[tag] = (
                "the pool refused its lease (evicted, reused or gone since the lookup)"
                if slot < 0
                else f"its tier cannot be reached ({path})"
            )
            return replace(obj, page_offsets=self._pages + np.uint64(1 << 60), checksum=None)
        return replace(obj, tier=reg, checksum=checksum)

    def _remote_options(self) -> Dict[str, Any]:
        """The engine's remote tier, where the pool's memory nodes are reached."""
        return self.cfg.remote_options()

    def _remote_tier(self, address: str, tier: int, size: int) -> Optional[Registration]:
        """Tier ``tier`` (its ``size`` bytes) of the memory node at ``address``: connected on
        first use (the handshake proves both sides hold the secret), its region registered
        once. None when it cannot be reached (logged; not tried again for a second). A node
        whose connection ended (it exited, or restarted at its address) is connected anew."""
        node = self._nodes.get(address)
        if node is not None and not self._eng().peer_alive(node[0]):
            self._retire_node(address)
            node = None
        if node is None:
            if time.monotonic() < self._nodes_down.get(address, 0.0):
                return None
            peer = self._connect(address)
            if peer is None:
                return None
            node = self._nodes[address] = (peer, {})
        peer, tiers = node
        reg = tiers.get((tier, size))
        if reg is None:
            region = next((r for r in peer.regions if r.region == tier), None)
            if region is None or not region.writable or region.length < size:
                logger.warning(
                    "UmbpConnector: memory node %s has no writable region %d of %d bytes",
                    address,
                    tier,
                    size,
                )
                return None
            try:
                reg = self._eng().register_remote(
                    region, 0, size, label=f"memory node {address} region {region.name}"
                )
            except Exception as e:
                logger.warning("UmbpConnector: cannot register memory node %s: %s", address, e)
                return None
            tiers[(tier, size)] = reg
        return reg

    def _connect(self, address: str) -> Any:
        """The connection to the memory node at ``address`` if it is made: it is made in the
        background, and a step waits for it a short while at most, so a node
        whose host vanished (connects that hang until their timeout) never stalls a step; its
        blocks fail meanwhile (loads are recomputed, saves dropped). None while it is being
        made, or when it failed (logged; not tried again for a second). The wait is
        ``remote_connect_wait_s``."""
        thread = self._connecting.get(address)
        if thread is None:
            thread = threading.Thread(
                target=self._connect_in_background,
                args=(address,),
                name=f"umbp-connect-{address}",
                daemon=True,
            )
            self._connecting[address] = thread
            thread.start()
        thread.join(float(self.cfg.remote_connect_wait_s))
        if thread.is_alive():
            return None
        del self._connecting[address]
        with self._connect_lock:
            peer, error = self._connected.pop(address)
        if error is not None:
            self._nodes_down[address] = time.monotonic() + 1.0
            logger.warning(
                "UmbpConnector: cannot reach memory node %s: %s (its blocks fail: loads "
                "are recomputed, saves dropped)",
                address,
                error,
            )
            return None
        return peer

    def _connect_in_background(self, address: str) -> None:
        try:
            outcome: Tuple[Any, Optional[BaseException]] = (self._eng().connect(address), None)
        except Exception as e:
            outcome = (None, e)
        with self._connect_lock:
            self._connected[address] = outcome

    def _retire_node(self, address: str) -> None:
        """Drops the connection to the memory node at ``address`` after a transfer through it
        failed (it died, restarted, or its bytes did not verify): the next use connects
        again."""
        node = self._nodes.pop(address, None)
        if node is None:
            return
        peer, tiers = node
        try:
            self._eng().disconnect(peer)
        except Exception as e:
            logger.debug("UmbpConnector: disconnecting memory node %s: %s", address, e)
        for reg in tiers.values():
            reg.close()

    def _peer_file(self, path: str, size: int) -> Optional[Registration]:
        """Another instance's SSD file, opened read-only (without its lock, which that
        instance holds: the pool's lease keeps the slot from being reused under the load, and
        the checksum verifies it). None when it cannot be opened (logged)."""
        if path in self._peer_files:
            return self._peer_files[path]
        if path == self.ssd_path:
            return self.ssd
        reg: Optional[Registration] = None
        try:
            reg = self._eng().register_file(
                path, 0, size, direct=self.cfg.ssd_direct, writable=False
            )
        except (OSError, RegistrationError) as e:
            logger.warning("UmbpConnector: cannot open another instance's SSD tier %s: %s", path, e)
        self._peer_files[path] = reg
        return reg

    def start_loads(self, meta: UmbpConnectorMetadata) -> None:
        self._step_load = None
        items, requests = [], []
        for rid, its in meta.loads.items():
            items.extend(its)
            requests.extend([rid] * len(its))
        if not items:
            return
        objects = self._objects(items, meta)
        batch = self._eng().start_restore(
            objects, timeout=self.cfg.load_timeout_s, stream=self._stream()
        )
        t = _Transfer(batch, "load", items, requests, layerwise=meta.layerwise, groups=meta.groups)
        self._transfers.append(t)
        if meta.layerwise:
            self._step_load = t

    def wait_for_layer(self, layer_name: str) -> None:
        t = self._step_load
        if t is None:
            return
        group = self._group_of.get(layer_name)
        if group is None:
            return
        start = time.perf_counter()
        if self.cuda:
            t.batch.wait_group_enqueued(group)
        else:
            t.batch.wait_group(group)
        self._stats.add("load_wait_s", time.perf_counter() - start)

    def start_saves(self, meta: UmbpConnectorMetadata) -> None:
        if self.saves_started:
            return  # wait_for_save may run twice in one step (draft models)
        self.saves_started = True
        items, requests = [], []
        for rid, its in meta.saves.items():
            items.extend(its)
            requests.extend([rid] * len(its))
        if items:
            objects = self._objects(items, meta)
            self._pool_saves.update(it[0] for it in items if it[0] in meta.pool)
            # On CUDA the reads of the KV cache queue on the compute stream, after this step's
            # forward pass wrote it; nothing here waits for them.
            batch = self._eng().start_offload(objects, stream=self._stream())
            t = _Transfer(batch, "save", items, requests, groups=meta.groups)
            self._transfers.append(t)
            for rid in meta.saves:
                self._req_saves.setdefault(rid, []).append(t)
        if meta.demotions:
            slot_bytes = self.layout.slot_bytes
            objects = []
            for k, (op, dram_slot, ssd_slot) in enumerate(meta.demotions):
                group = meta.groups.get(op, 0)
                size = self._groups[group].object_bytes
                page, pages = self._paging[group]
                objects.append(
                    Object(
                        k,
                        self._tier(SSD),
                        pages + ssd_slot * slot_bytes,
                        page,
                        size,
                        [Range(0, size, self._tier(DRAM), dram_slot * slot_bytes)],
                    )
                )
            batch = self._eng().start_offload(objects)
            items = [(op, SSD, ssd_slot, -1) for op, _, ssd_slot in meta.demotions]
            self._transfers.append(
                _Transfer(batch, "demote", items, [""] * len(items), groups=meta.groups)
            )

    def preempted(self, meta: UmbpConnectorMetadata) -> None:
        """The blocks of preempted requests are about to be reused: their saves must have
        read them first."""
        for rid in meta.preempted:
            for t in self._req_saves.get(rid, ()):
                t.batch.wait()
        if not self.cuda and self.layout.groups:
            # A sliding-window group's blocks leave a running request as its window moves,
            # and may be reused by this step: a save still reading one must finish first. (On
            # CUDA a save's reads are queued on the compute stream, before this step's
            # kernels.)
            windowed = {g for g, lay in enumerate(self._groups) if lay.window is not None}
            for t in self._transfers:
                if t.kind == "save" and windowed & set(t.groups.values()):
                    t.batch.wait()

    # -- completion --------------------------------------------------------------------------

    def _settle(self, t: _Transfer, recving: Set[str]) -> None:
        report = t.batch.wait()
        for o in report.objects:
            op, tier, slot, block = t.items[o.tag]
            size = self._groups[t.groups.get(op, 0)].object_bytes
            if t.kind == "save" and op in self._pool_saves:
                self._pool_saves.discard(op)
                if o.ok and o.checksum is not None:
                    self._crcs[op] = {self.rank: int(o.checksum)}
            node = self._remote_ops.pop(op, None)
            if node is not None and not o.ok:
                self._retire_node(node)  # dead, restarted or wrong: connect anew next time
            if t.kind != "load":
                # The slot now holds this save's bytes (their checksum, or None where the
                # engine's policy leaves the tier unhashed), or, after a failure, unknown ones.
                if o.ok:
                    self._checksums[(tier, slot)] = o.checksum
                else:
                    self._checksums.pop((tier, slot), None)
            if o.ok:
                self._ok[op] = self._ok.get(op, 0) + 1
            else:
                self._failed[op] = self._failed.get(op, 0) + 1
                why = self._refused_ops.pop(op, None)
                if why is not None:
                    logger.warning(
                        "UmbpConnector: %s of block %d failed: %s%s",
                        t.kind,
                        block,
                        why,
                        "; vLLM recomputes it" if t.kind == "load" else "",
                    )
                else:
                    logger.warning(
                        "UmbpConnector: %s of block %d (%s) failed: %s",
                        t.kind,
                        block,
                        tier,
                        o.error,
                    )
            if t.kind == "load":
                if o.ok:
                    self._stats.add(f"loaded_blocks.{tier}", 1)
                    self._stats.add(f"loaded_bytes.{tier}", size)
                else:
                    if self.layout.groups:
                        # Block ids name no block across groups for vLLM: the request fails.
                        self._failed_requests.add(t.requests[o.tag])
                    else:
                        self._load_errors.add(block)
                    self._stats.add(f"load_errors.{tier}", 1)
                    if getattr(o.error, "kind", None) == FailureKind.CHECKSUM_MISMATCH:
                        self._stats.add(f"corrupt_blocks.{tier}", 1)
            elif t.kind == "save":
                self._stats.add(f"saved_blocks.{tier}" if o.ok else f"save_errors.{tier}", 1)
                if o.ok:
                    self._stats.add(f"saved_bytes.{tier}", size)
            else:
                self._stats.add("demoted_blocks.ssd" if o.ok else "demote_errors.ssd", 1)
        if t.kind == "load" and not t.layerwise:
            recving.update(t.requests)
        if t.kind == "save":
            for rid in set(t.requests):
                left = [x for x in self._req_saves.get(rid, ()) if x is not t]
                if left:
                    self._req_saves[rid] = left
                else:
                    self._req_saves.pop(rid, None)

    def finished(self, meta: Optional[UmbpConnectorMetadata]) -> Tuple[Set[str], Set[str]]:
        if meta is not None:
            self._hold.update(meta.hold)
        recving: Set[str] = set()
        pending = []
        for t in self._transfers:
            # This step's layer-wise load fed this step's forward: it settles now, so its
            # failures are reported in this step.
            if t.batch.done() or t is self._step_load:
                self._settle(t, recving)
            else:
                pending.append(t)
        self._transfers = pending
        self._step_load = None
        sending = {rid for rid in self._hold if rid not in self._req_saves}
        self._hold -= sending
        return sending, recving

    def load_errors(self) -> Set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def failed_requests(self) -> Set[str]:
        out, self._failed_requests = self._failed_requests, set()
        return out

    def worker_meta(self) -> Optional[UmbpWorkerMetadata]:
        if not self._ok and not self._failed:
            return None
        meta = UmbpWorkerMetadata(self._ok, self._failed, self._crcs)
        self._ok, self._failed, self._crcs = {}, {}, {}
        return meta

    def stats(self) -> Optional[UmbpConnectorStats]:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, UmbpConnectorStats()
        return out

    def close(self) -> None:
        for t in self._transfers:
            t.batch.wait()
        self._transfers = []
        for address in list(self._nodes):
            self._retire_node(address)
        for reg in [self.dram, self.ssd, *self._registrations, *self._peer_files.values()]:
            if reg is not None:
                reg.close()
        self._registrations = []
        self._peer_files = {}
        self.dram = self.ssd = None
