"""umbp as an SGLang HiCache storage backend: ``UmbpHiCacheStorage``, loaded by SGLang (0.5.23)
by module path and class name.

Enable it with::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "umbp",
            "module_path": "umbp.sglang", "class_name": "UmbpHiCacheStorage",
            "interface_v1": 1, "dram_bytes": 17179869184,
            "ssd_path": "/nvme/umbp-hicache", "ssd_bytes": 549755813888}'

What is stored: one umbp object per HiCache page, named by SGLang's page hash (which chains
the hashes of the pages before it), holding the page's bytes as SGLang's host pool lays them
out (``get_page_buffer_meta``: K then V of all layers for the page-first layouts, K and V of
each layer in turn for ``layer_first``), in one *slot* of a tier: a DRAM arena of
``dram_bytes`` and, with ``ssd_path``, an SSD file of ``ssd_bytes``. A per-key index
(:class:`umbp.kvtiers.TierIndex`: LRU per tier, demotion from DRAM to SSD when DRAM fills)
decides where; umbp moves the bytes. With ``"interface_v1": 1`` SGLang calls the zero-copy
``batch_get_v1`` / ``batch_set_v1``: the host pool's buffer is registered with umbp once, and
each page moves between it and its slot by offset, in one umbp batch per call (no Python copy
of any page). Without it SGLang calls the older ``batch_get`` / ``batch_set`` with a tensor
per page, which are registered for the call.

Failures are per key: ``batch_get_v1`` / ``batch_set_v1`` return one bool per key. A load
whose bytes did not arrive whole (an I/O error, a deadline) or whose CRC32C does not match
the one its save reported (SSD pages, and DRAM pages with ``"checksums": "all_tiers"``) is
``False`` for that key alone, and the index forgets the key (SGLang then recomputes it). A
save that gets no slot or fails is ``False`` for its key. SGLang stops a prefetch at the first
missing page.

Each instance (a tensor-, pipeline- or data-parallel rank) keeps its own tiers; its SSD file
is named after its ranks and held under an exclusive lock while it runs, so a second instance
given the same file stops at start. The index lives in memory: a restarted server starts
empty (the SSD file's old bytes are overwritten as it fills).

With ``"pool"`` (``"embedded"``, a path, or ``"redis://..."``; the pool's keys are the vLLM
connector's, :class:`umbp.poolkeys.PoolKeys`) the pages live in the umbp pool instead
(:mod:`umbp.sglang.pooled`): an embedded index kept across restarts (reconciled with the SSD
file at start), or one in Redis shared by every instance and host, with memory nodes. SGLang's
own extra-config keys (:data:`SGLANG_KEYS`) are left to SGLang. ``python -m
umbp.sglang.check CONFIG`` runs a config through SGLang's own controller on CPU
(:mod:`umbp.sglang.check`).

SGLang calls a backend from several threads at once (its prefetch, prefetch I/O and backup
threads); every method here may be called from any thread.

See docs/SGLANG.md for every extra-config key and the limits.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
# SGLang ships no type information (no py.typed): its classes are Any to mypy.
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from .. import ChecksumPolicy, Engine, Object, Range, Registration, RegistrationError
from ..kvpool import SAVE_MEMORY_NODES_ONLY
from ..kvtiers import DRAM, SSD, TierIndex
from ..poolkeys import PoolKeys

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache  # type: ignore[import-untyped]

    from .pooled import PoolPages

__all__ = ["UmbpHiCacheStorage", "UmbpStorageConfig"]

logger = logging.getLogger(__name__)

#: Slots start on this boundary in the tiers, so an SSD slot is aligned for O_DIRECT.
SLOT_ALIGN = 4096

#: Objects are paged in the tiers by at most this much: the SSD engine moves a fragment of
#: at most its maximum segment (1 MiB) at once.
TIER_PAGE = 1 << 20

#: The extra-config keys SGLang itself reads (left to it): its storage factory's, the
#: zero-copy switch, its cache controller's ``tp_lcm_size``, and the prefetch knobs its
#: controllers pop (``HybridCacheController.parse_storage_backend_extra_config``). The
#: decode side's KV offload (``DecodeKVCacheOffloadManager``) hands the backend the raw
#: config, with them still in it.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)


@dataclass(frozen=True)
class UmbpStorageConfig(PoolKeys):
    """Our keys of ``--hicache-storage-backend-extra-config`` (docs/SGLANG.md explains each;
    the pool's keys are :class:`umbp.poolkeys.PoolKeys`, named as in the vLLM connector)."""

    dram_bytes: int = 4 << 30
    ssd_path: Optional[str] = None
    ssd_bytes: int = 0
    ssd_direct: bool = True
    dram_free_fraction: float = 0.05
    checksums: str = "files_and_remote"
    load_timeout_s: Optional[float] = None
    engine_workers: int = 8

    @staticmethod
    def from_extra(extra: Optional[Dict[str, Any]]) -> "UmbpStorageConfig":
        """Parses and checks our keys; an unknown key or a bad value raises ``ValueError``
        naming it (a typo must not silently fall back to a default)."""
        ours = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
        UmbpStorageConfig.refuse_unknown(ours, "umbp.sglang: unknown extra-config")
        cfg = UmbpStorageConfig(**ours)

        def whole(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"umbp.sglang: {name} must be a non-negative integer")

        whole("dram_bytes", cfg.dram_bytes)
        whole("ssd_bytes", cfg.ssd_bytes)
        if cfg.ssd_bytes and not cfg.ssd_path:
            raise ValueError("umbp.sglang: ssd_bytes needs ssd_path")
        if cfg.ssd_path and not cfg.ssd_bytes:
            raise ValueError("umbp.sglang: ssd_path needs ssd_bytes")
        if not cfg.dram_bytes and not cfg.ssd_bytes and cfg.pool_save_to != SAVE_MEMORY_NODES_ONLY:
            raise ValueError("umbp.sglang: give dram_bytes or ssd_bytes (both are 0)")
        if not isinstance(cfg.dram_free_fraction, (int, float)) or not (
            0.0 <= float(cfg.dram_free_fraction) < 1.0
        ):
            raise ValueError("umbp.sglang: dram_free_fraction must lie in [0, 1)")
        try:
            ChecksumPolicy(cfg.checksums)
        except ValueError:
            raise ValueError(
                "umbp.sglang: checksums must be one of "
                f"{[p.value for p in ChecksumPolicy]}, not {cfg.checksums!r}"
            ) from None
        if cfg.load_timeout_s is not None and not float(cfg.load_timeout_s) > 0:
            raise ValueError("umbp.sglang: load_timeout_s must be positive")
        if isinstance(cfg.engine_workers, bool) or not isinstance(cfg.engine_workers, int) or not (
            1 <= cfg.engine_workers <= 1024
        ):
            raise ValueError("umbp.sglang: engine_workers must be an integer in 1..=1024")
        cfg.check_pool_keys("umbp.sglang", ssd_path=cfg.ssd_path, checksums=cfg.checksums)
        return cfg

    def engine_options(self) -> Dict[str, Any]:
        """The :class:`umbp.Engine` keyword arguments: the checksum policy (a pool whose
        blocks go to DRAM hashes DRAM too) and, with memory nodes, the remote tier."""
        return dict(
            checksums=self.pool_checksums(self.checksums, durable=bool(self.ssd_path)),
            **self.remote_options(),
        )

    def pool_file(self, sc: HiCacheStorageConfig) -> Optional[str]:
        """This rank's embedded pool index (a redb file): beside its SSD file with
        ``"pool": "embedded"``, or the path given (its rank placeholders replaced as in
        :meth:`ssd_file`); None for a Redis pool or none."""
        if self.pool is None or "://" in self.pool:
            return None
        if self.pool == "embedded":
            ssd = self.ssd_file(sc)
            assert ssd is not None  # checked: the embedded pool needs ssd_path
            return ssd + ".pool.redb"
        return rank_path(self.pool, sc)

    def ssd_file(self, sc: HiCacheStorageConfig) -> Optional[str]:
        """This instance's SSD file: ``{tp_rank}``, ``{pp_rank}``, ``{dp_rank}`` and
        ``{cp_rank}`` in ``ssd_path`` are replaced by its ranks; a rank the path does not
        name is appended (``.tp1``, ``.pp1``, ``.dp1``, ``.cp1``) where its group has more
        than one member (the data-parallel rank: where it is not 0), so every instance
        given one ``ssd_path`` gets a file of its own."""
        return rank_path(self.ssd_path, sc) if self.ssd_path else None


def rank_path(path: str, sc: HiCacheStorageConfig) -> str:
    """``path`` for this rank: ``{tp_rank}``, ``{pp_rank}``, ``{dp_rank}`` and ``{cp_rank}``
    replaced by its ranks, and a rank the path does not name appended (``.tp1``, ``.pp1``,
    ``.dp1``, ``.cp1``) where its group has more than one member (the data-parallel rank:
    where it is not 0)."""
    for name, rank, many in (
        ("tp_rank", sc.tp_rank, sc.tp_size > 1),
        ("pp_rank", sc.pp_rank, sc.pp_size > 1),
        ("dp_rank", sc.dp_rank, sc.dp_rank != 0),
        ("cp_rank", sc.attn_cp_rank, sc.attn_cp_size > 1),
    ):
        placeholder = "{" + name + "}"
        if placeholder in path:
            path = path.replace(placeholder, str(rank))
        elif many:
            path = f"{path}.{name[:2]}{rank}"
    return path


def rank_index(sc: HiCacheStorageConfig) -> int:
    """This rank's index among the instance's ranks (data-, pipeline-, context- and
    tensor-parallel, in that order)."""
    return int(
        ((sc.dp_rank * sc.pp_size + sc.pp_rank) * sc.attn_cp_size + sc.attn_cp_rank) * sc.tp_size
        + sc.tp_rank
    )


def open_locked_file(engine: Engine, path: str, size: int, direct: bool) -> Registration:
    """Registers ``size`` bytes of the SSD tier file ``path`` (created, or kept from the last
    run), held under an exclusive lock: another instance's saves into it would overwrite this
    one's slots, and its loads would then serve them as hits. A file in use raises
    ``RuntimeError`` saying so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        return engine.register_file(
            path, 0, size, direct=direct, create=True, extend=True, exclusive=True
        )
    except RegistrationError as e:
        if e.errno != errno.EWOULDBLOCK:
            raise
        raise RuntimeError(
            f"umbp.sglang: the SSD tier file {path} is in use by another instance "
            "(another SGLang server or rank given the same ssd_path): give each "
            "its own ssd_path, or put {tp_rank}/{dp_rank} in it"
        ) from e


class _Regions:
    """The host pool's buffers, registered once: maps an address to (registration, offset)."""

    def __init__(self, engine: Engine, buffers: Sequence[torch.Tensor]):
        spans = []
        for b in buffers:
            flat = b.reshape(-1).view(torch.uint8)  # registers any dtype (fp8, ...) as bytes
            spans.append((flat.data_ptr(), flat.numel(), engine.register(flat)))
        spans.sort(key=lambda s: s[0])
        self._bases = [s[0] for s in spans]
        self._spans = spans

    def locate(self, address: int, length: int) -> Tuple[Registration, int]:
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0:
            raise ValueError(f"address {address:#x} lies outside the host pool")
        base, size, reg = self._spans[i]
        if address + length > base + size:
            raise ValueError(f"bytes at {address:#x} (+{length}) lie outside the host pool")
        return reg, address - base

    def close(self) -> None:
        for _, _, reg in self._spans:
            reg.close()


def _pool_buffers(pool: Any) -> List[torch.Tensor]:
    kv = getattr(pool, "kv_buffer", None)
    if isinstance(kv, torch.Tensor):
        return [kv]
    if isinstance(kv, (list, tuple)) and kv and all(isinstance(t, torch.Tensor) for t in kv):
        return list(kv)
    raise NotImplementedError(
        f"umbp.sglang cannot address the host pool {type(pool).__name__} (no kv_buffer tensor)"
    )


class UmbpHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # (SGLang's class is Any)
    """SGLang's ``HiCacheStorage`` over umbp's tiers. Built by SGLang's
    ``StorageBackendFactory`` as ``UmbpHiCacheStorage(storage_config, kwargs)``; the tiers open
    when SGLang registers its host pool (``register_mem_pool_host``), whose page size they
    are cut to."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None
    ):
        self.storage_config = storage_config
        self.cfg = UmbpStorageConfig.from_extra(storage_config.extra_config)
        if storage_config.is_mla_model and storage_config.tp_size > 1 and self.cfg.pool is None:
            # SGLang lets only one rank of an MLA model write (is_storage_writer), and each
            # rank here reads only its own tiers: the others would never hit.
            raise ValueError(
                "umbp.sglang keeps each rank's pages in that rank's own tiers, and SGLang "
                "saves an MLA model's pages from one rank only: run an MLA model with "
                "tp_size 1, or use a backend the ranks share"
            )
        self.engine = Engine(
            "sim",  # no device memory is ever touched: host pool <-> DRAM arena / SSD file
            pin_device=None,  # SGLang pins its host pool itself
            workers=self.cfg.engine_workers,
            **self.cfg.engine_options(),
        )
        self._lock = threading.Lock()
        self._index: Optional[TierIndex] = None
        #: The pool's pages, with ``"pool"`` (instead of the in-process index and tiers).
        self.pooled: Optional["PoolPages"] = None
        # key -> (tier, slot, crc32c) of the copy a completed save or demotion wrote there.
        self._sums: Dict[str, Tuple[str, int, int]] = {}
        self._regions: Optional[_Regions] = None
        self._arena: Optional[np.ndarray] = None
        self.dram: Optional[Registration] = None
        self.ssd: Optional[Registration] = None
        self.ssd_path: Optional[str] = None
        self._dram_slots = 0
        self.page_tokens = 0
        self.object_bytes = 0
        self.slot_bytes = 0
        self._page = 0
        self._pages = np.zeros(0, dtype=np.uint64)
        self._closed = False

    # -- set-up --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: "HostKVCache") -> None:
        """Cuts the tiers to the host pool's page (as ``get_page_buffer_meta`` describes it)
        and opens them. The pool's buffer itself registers on the first zero-copy call: the
        tensor-per-page calls register the tensors they are given instead, which may be views
        of the pool (an MLA pool's ``get_data_page``) that must not overlap a registration."""
        super().register_mem_pool_host(mem_pool_host)
        pool: Any = mem_pool_host
        with self._lock:
            if self._index is not None or self.pooled is not None:
                raise RuntimeError("umbp.sglang: a host pool is registered already")
            _pool_buffers(pool)  # refused now if its bytes cannot be addressed
            page_tokens = int(pool.page_size)
            _, sizes = pool.get_page_buffer_meta(torch.arange(page_tokens, dtype=torch.int64))
            self.page_tokens = page_tokens
            self.object_bytes = int(sum(int(s) for s in sizes))
            if self.object_bytes <= 0:
                raise NotImplementedError("umbp.sglang: the host pool describes empty pages")
            self.slot_bytes = -(-self.object_bytes // SLOT_ALIGN) * SLOT_ALIGN
            self._page = min(self.object_bytes, TIER_PAGE)
            self._pages = (
                np.arange(-(-self.object_bytes // self._page), dtype=np.uint64) * self._page
            )
            if self.cfg.pool is not None:
                self._open_pool(pool)
            else:
                self._open_tiers()

    def _open_pool(self, pool: Any) -> None:
        """Opens this rank's pages in the pool, cut to the host pool's runs of a page."""
        from .pooled import PoolPages

        sc = self.storage_config
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_tokens, dtype=torch.int64))
        parts: List[int] = []
        end = -1
        for ptr, size in zip(ptrs, sizes):
            if int(ptr) == end:
                parts[-1] += int(size)
            else:
                parts.append(int(size))
            end = int(ptr) + int(size)
        shape = {
            "backend": "umbp.sglang",
            "model": sc.model_name,
            "namespace": self.cfg.pool_namespace,
            "layout": str(getattr(pool, "layout", "")),
            "dtype": str(getattr(pool, "dtype", "")),
            "host_pool": type(pool).__name__,
            "page_tokens": self.page_tokens,
            "page_bytes": self.object_bytes,
            "runs": parts,
            # Without interface_v1 a page is SGLang's flat data page, whose byte order differs
            # from the host pool's runs in some layouts (layer_first): the two never share.
            "interface_v1": bool((sc.extra_config or {}).get("interface_v1", 0)),
            # An MLA model's ranks hold the same bytes (SGLang saves them from one rank):
            # they share keys, so every rank hits what that one saved.
            "tp": [sc.tp_size, 0 if sc.is_mla_model else sc.tp_rank],
            "pp": [sc.pp_size, sc.pp_rank],
            "cp": [sc.attn_cp_size, sc.attn_cp_rank],
        }
        namespace = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).digest()
        self.pooled = PoolPages(
            self.cfg,
            self.engine,
            parts=parts,
            namespace=namespace,
            rank=rank_index(sc),
            ssd_file=self.cfg.ssd_file(sc),
            pool_file=self.cfg.pool_file(sc),
            ssd_direct=self.cfg.ssd_direct,
            load_timeout_s=self.cfg.load_timeout_s,
        )
        self.ssd_path = self.pooled.ssd_file

    def _open_tiers(self) -> None:
        cfg = self.cfg
        slot = self.slot_bytes
        dram_slots = cfg.dram_bytes // slot
        ssd_slots = cfg.ssd_bytes // slot
        if dram_slots + ssd_slots == 0:
            raise ValueError(
                f"umbp.sglang: dram_bytes and ssd_bytes hold no page of {slot} bytes"
            )
        self._dram_slots = dram_slots
        if dram_slots:
            self._arena = np.zeros(dram_slots * slot, dtype=np.uint8)
            self.dram = self.engine.register(self._arena)
        try:
            self._open_ssd(ssd_slots)
        except BaseException:
            if self.dram is not None:
                self.dram.close()
                self.dram, self._arena = None, None
            raise
        free = int(dram_slots * float(cfg.dram_free_fraction))
        self._index = TierIndex(
            dram_slots, ssd_slots if self.ssd is not None else 0, dram_free_slots=max(free, 1)
        )
        logger.info(
            "umbp.sglang: pages of %d bytes; %d DRAM slots, %d SSD slots%s",
            self.object_bytes,
            dram_slots,
            ssd_slots if self.ssd is not None else 0,
            f" in {self.ssd_path}" if self.ssd is not None else "",
        )

    def _open_ssd(self, ssd_slots: int) -> None:
        cfg = self.cfg
        slot = self.slot_bytes
        path = cfg.ssd_file(self.storage_config)
        if path and ssd_slots:
            self.ssd = open_locked_file(self.engine, path, ssd_slots * slot, cfg.ssd_direct)
            self.ssd_path = path

    def _idx(self) -> TierIndex:
        if self._closed:
            raise RuntimeError("umbp.sglang: the backend is closed")
        if self._index is None:
            raise RuntimeError("umbp.sglang: register_mem_pool_host has not run")
        return self._index

    def _ready(self) -> None:
        """Raises unless the backend is open and its pages are (a host pool registered)."""
        if self._closed:
            raise RuntimeError("umbp.sglang: the backend is closed")
        if self._index is None and self.pooled is None:
            raise RuntimeError("umbp.sglang: register_mem_pool_host has not run")

    def _host_regions(self) -> _Regions:
        with self._lock:
            self._ready()
            if self._regions is None:
                self._regions = _Regions(self.engine, _pool_buffers(self.mem_pool_host))
            return self._regions

    def _tier(self, tier: str) -> Registration:
        reg = self.dram if tier == DRAM else self.ssd
        assert reg is not None, tier  # the index hands out slots of open tiers only
        return reg

    def _object(
        self, tag: int, tier: str, slot: int, ranges: List[Range], checksum: Optional[int] = None
    ) -> Object:
        return Object(
            tag,
            self._tier(tier),
            self._pages + np.uint64(slot * self.slot_bytes),
            self._page,
            self.object_bytes,
            ranges,
            checksum,
        )

    def _page_ranges(self, host_indices: torch.Tensor, n: int) -> List[List[Range]]:
        """Each of the ``n`` pages' ranges in the host pool, from the pool's own
        ``get_page_buffer_meta`` (addresses, not copies)."""
        regions = self._host_regions()
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) % n or len(sizes) != len(ptrs):
            raise ValueError("umbp.sglang: the host pool describes pages unevenly")
        per = len(ptrs) // n
        out = []
        for p in range(n):
            ranges: List[Range] = []
            at = 0
            for j in range(p * per, (p + 1) * per):
                size = int(sizes[j])
                reg, offset = regions.locate(int(ptrs[j]), size)
                last = ranges[-1] if ranges else None
                if (
                    last is not None
                    and last.endpoint is reg
                    and last.endpoint_offset + last.length == offset
                ):
                    ranges[-1] = Range(last.offset, last.length + size, reg, last.endpoint_offset)
                else:
                    ranges.append(Range(at, size, reg, offset))
                at += size
            if at != self.object_bytes:
                raise ValueError(
                    f"umbp.sglang: a page of {at} bytes, not the {self.object_bytes} registered"
                )
            out.append(ranges)
        return out

    def _ranges_or_none(self, host_indices: torch.Tensor, n: int) -> Optional[List[List[Range]]]:
        try:
            return self._page_ranges(host_indices, n)
        except ValueError as e:  # indices outside the pool: nothing moves, nothing is dropped
            logger.error("umbp.sglang: %s", e)
            return None

    def _checks(self, host_indices: torch.Tensor, n: int) -> bool:
        if host_indices.numel() != n * self.page_tokens:
            logger.error(
                "umbp.sglang: %d keys need %d host indices, got %d",
                n,
                n * self.page_tokens,
                host_indices.numel(),
            )
            return False
        return True

    # -- moving pages --------------------------------------------------------------------

    def _load(self, keys: List[str], ranges_of: Callable[[int], List[Range]]) -> List[bool]:
        """Restores each hit key's page into the ranges ``ranges_of(i)`` gives; one bool
        per key."""
        if self.pooled is not None:
            self._ready()
            return self.pooled.load(keys, [ranges_of(i) for i in range(len(keys))])
        results = [False] * len(keys)
        plans: List[Tuple[int, int, str, int, Optional[int]]] = []
        with self._lock:
            index = self._idx()
            for i, key in enumerate(keys):
                if not index.is_hit(key):
                    continue
                op, tier, slot = index.begin_load(key)
                s = self._sums.get(key)
                crc = s[2] if s is not None and s[0] == tier and s[1] == slot else None
                plans.append((i, op, tier, slot, crc))
        if not plans:
            return results
        try:
            objects = [
                self._object(k, tier, slot, ranges_of(i), crc)
                for k, (i, _, tier, slot, crc) in enumerate(plans)
            ]
            report = self.engine.restore(objects, timeout=self.cfg.load_timeout_s)
            oks = [o.ok for o in report.objects]
            errors = [o.error for o in report.objects]
        except Exception:
            logger.exception("umbp.sglang: a load batch failed to start")
            oks, errors = [False] * len(plans), [None] * len(plans)
        with self._lock:
            index = self._idx()
            for (i, op, tier, _, _), ok, error in zip(plans, oks, errors):
                results[i] = ok
                if ok:
                    index.report(op, ok=1)
                else:
                    index.report(op, failed=1)
                    logger.warning("umbp.sglang: load of %s (%s) failed: %s", keys[i], tier, error)
        return results

    def _save(self, keys: List[str], ranges_of: Callable[[int], List[Range]]) -> List[bool]:
        """Offloads each key not stored yet from the ranges ``ranges_of(i)`` gives; a key
        stored already (or being stored) counts as saved. One bool per key."""
        if self.pooled is not None:
            self._ready()
            return self.pooled.save(keys, [ranges_of(i) for i in range(len(keys))])
        results = [False] * len(keys)
        plans: List[Tuple[int, int, str, int]] = []
        with self._lock:
            index = self._idx()
            fresh = len({k for k in keys if index.entry(k) is None})
        if fresh:
            self._demote(fresh)
        with self._lock:
            index = self._idx()
            seen = set()
            for i, key in enumerate(keys):
                if key in seen or index.entry(key) is not None:
                    results[i] = True
                    continue
                seen.add(key)
                planned = index.begin_save(key)
                if planned is not None:
                    plans.append((i, *planned))
        if plans:
            try:
                objects = [
                    self._object(k, tier, slot, ranges_of(i))
                    for k, (i, _, tier, slot) in enumerate(plans)
                ]
                report = self.engine.offload(objects)
                outcomes = [(o.ok, o.checksum, o.error) for o in report.objects]
            except Exception:
                logger.exception("umbp.sglang: a save batch failed to start")
                outcomes = [(False, None, None)] * len(plans)
            with self._lock:
                index = self._idx()
                for (i, op, tier, slot), (ok, crc, error) in zip(plans, outcomes):
                    if ok:
                        index.report(op, ok=1)
                        self._record(keys[i], tier, slot, crc)
                    else:
                        index.report(op, failed=1)
                        logger.warning("umbp.sglang: save of %s failed: %s", keys[i], error)
                    results[i] = ok
        self._demote()
        return results

    def _record(self, key: str, tier: str, slot: int, crc: Optional[int]) -> None:
        """Keeps the checksum of the copy of ``key`` at (tier, slot); called under the lock.
        Stale entries (keys evicted since) are pruned once they outnumber the index."""
        if crc is None:
            self._sums.pop(key, None)
        else:
            self._sums[key] = (tier, slot, crc)
        index = self._index
        if index is not None and len(self._sums) > 2 * len(index) + 1024:
            for k in list(self._sums):
                e = index.entry(k)
                t, s, _ = self._sums[k]
                if e is None or e.tier != t or e.slot != s:
                    del self._sums[k]

    def _demote(self, room: int = 0) -> None:
        """Moves the least recent DRAM pages to the SSD tier until ``room`` DRAM slots, and
        at least ``dram_free_fraction`` of them, are free (without an SSD tier the index drops
        them): before a save, so that new pages land in DRAM, and after it."""
        with self._lock:
            index = self._idx()
            base = index.dram_free_slots
            index.dram_free_slots = min(max(base, room), self._dram_slots)
            try:
                planned = index.plan_demotions()
            finally:
                index.dram_free_slots = base
            plans = [
                # The key each demotion moves (TierIndex hands out the op; its key is read
                # here, under the same lock, before any report can settle it).
                (op, dram_slot, ssd_slot, str(index._ops[op].key))
                for op, dram_slot, ssd_slot in planned
            ]
        if not plans:
            return
        dram, size = self._tier(DRAM), self.object_bytes
        try:
            objects = [
                self._object(k, SSD, ssd_slot, [Range(0, size, dram, dram_slot * self.slot_bytes)])
                for k, (_, dram_slot, ssd_slot, _) in enumerate(plans)
            ]
            report = self.engine.offload(objects)
            outcomes = [(o.ok, o.checksum) for o in report.objects]
        except Exception:
            logger.exception("umbp.sglang: a demotion batch failed to start")
            outcomes = [(False, None)] * len(plans)
        with self._lock:
            index = self._idx()
            for (op, _, ssd_slot, key), (ok, crc) in zip(plans, outcomes):
                if ok:
                    index.report(op, ok=1)
                    e = index.entry(key)
                    if e is not None and e.tier == SSD and e.slot == ssd_slot:
                        self._record(key, SSD, ssd_slot, crc)
                else:
                    index.report(op, failed=1)

    # -- SGLang's interface: zero-copy (interface_v1) ------------------------------------

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Loads each key's page into the host pool at its ``page_size`` host indices; one
        bool per key (False: not stored, or its load failed)."""
        if not keys:
            return []
        if not self._checks(host_indices, len(keys)):
            return [False] * len(keys)
        ranges = self._ranges_or_none(host_indices, len(keys))
        if ranges is None:
            return [False] * len(keys)
        return self._load(keys, lambda i: ranges[i])

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Saves each key's page from the host pool at its ``page_size`` host indices; one
        bool per key (True also for a key stored already)."""
        if not keys:
            return []
        if not self._checks(host_indices, len(keys)):
            return [False] * len(keys)
        ranges = self._ranges_or_none(host_indices, len(keys))
        if ranges is None:
            return [False] * len(keys)
        return self._save(keys, lambda i: ranges[i])

    # -- SGLang's interface: a tensor per page (without interface_v1) -------------------

    def _flat(self, tensors: Sequence[Any]) -> Tuple[List[Optional[Registration]], List[Any]]:
        """Registers each tensor holding exactly one page; None for one that does not."""
        regs: List[Optional[Registration]] = []
        flats = []
        for t in tensors:
            reg = None
            flat = None
            if (
                isinstance(t, torch.Tensor)
                and t.device.type == "cpu"
                and t.is_contiguous()
                and t.numel() * t.element_size() == self.object_bytes
            ):
                flat = t.reshape(-1).view(torch.uint8)
                try:
                    reg = self.engine.register(flat)
                except (RegistrationError, TypeError, ValueError) as e:
                    logger.warning("umbp.sglang: a page tensor does not register: %s", e)
            regs.append(reg)
            flats.append(flat)
        return regs, flats

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[Optional[torch.Tensor]]:
        """Loads each key's page into its target tensor (``get_dummy_flat_data_page``);
        the tensor, or None where the key is not stored or its load failed."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            return [None] * len(keys)
        self._ready()
        regs, _ = self._flat(target_locations)
        try:
            usable = [(i, r) for i, r in enumerate(regs) if r is not None]
            sub = [keys[i] for i, _ in usable]
            oks = self._load(sub, lambda j: [Range(0, self.object_bytes, usable[j][1], 0)])
            out: List[Optional[torch.Tensor]] = [None] * len(keys)
            for (j, _), ok in zip(usable, oks):
                if ok:
                    out[j] = target_locations[j]
            return out
        finally:
            for r in regs:
                if r is not None:
                    r.close()

    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> Optional[torch.Tensor]:
        """:meth:`batch_get` of one key."""
        return self.batch_get([key], [target_location])[0]

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Saves each key's page from its tensor (``get_data_page``); whether all were."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False
        self._ready()
        values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        regs, _ = self._flat(values)
        try:
            held = [r for r in regs if r is not None]
            if len(held) != len(regs):
                return False
            return all(self._save(keys, lambda i: [Range(0, self.object_bytes, held[i], 0)]))
        finally:
            for r in regs:
                if r is not None:
                    r.close()

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """:meth:`batch_set` of one key."""
        return self.batch_set([key], [value])

    # -- SGLang's interface: lookups and the rest ----------------------------------------

    def exists(self, key: str) -> bool:
        """Whether ``key`` can be loaded now (its save completed)."""
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        """How many of ``keys``, from the first, can be loaded now."""
        if self.pooled is not None:
            self._ready()
            return self.pooled.prefix(keys)
        with self._lock:
            return self._idx().count_hits(keys)

    def clear(self) -> None:
        """Forgets every stored page (SGLang's cache flush); pages in flight finish. A pool's
        pages are shared with other instances (and kept for the next start): they stay."""
        if self.pooled is not None:
            self._ready()
            logger.info("umbp.sglang: a cache flush leaves the pool's pages (shared) in place")
            return
        with self._lock:
            dropped = self._idx().clear()
            self._sums.clear()
        logger.info("umbp.sglang: cleared %d pages", dropped)

    def get_stats(self) -> None:
        """SGLang's storage metrics are not reported (``engine.metrics()`` has umbp's)."""
        return None

    def close(self) -> None:
        """Ends the registrations (waiting for batches in flight) and unlocks the SSD file;
        SGLang calls it when it detaches the backend. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions, self._regions = self._regions, None
            dram, ssd = self.dram, self.ssd
            self.dram = self.ssd = None
            pooled, self.pooled = self.pooled, None
        if pooled is not None:
            pooled.close()
        if regions is not None:
            regions.close()
        for reg in (dram, ssd):
            if reg is not None:
                reg.close()
