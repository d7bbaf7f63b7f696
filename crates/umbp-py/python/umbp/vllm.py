"""umbp as a vLLM KV connector: ``UmbpConnector``, loaded by vLLM (0.33) by name.

Enable it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "UmbpConnector",
        "kv_connector_module_path": "umbp.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"dram_bytes_per_rank": 17179869184,
                                      "ssd_path": "/nvme/umbp-kv", "ssd_bytes_per_rank": 549755813888}}'

What is stored: one umbp object per KV block, holding every layer of the block (layer after
layer, ``page_size_bytes`` each) in one *slot* of a tier, named by vLLM's block hash (which
chains the hashes of the blocks before it). The scheduler side keeps the index (which hash is
in which tier and slot, :class:`umbp.kvtiers.TierIndex`: LRU per tier, demotion from DRAM to
SSD under pressure) and tells the workers, in the connector metadata, what to load into which
GPU blocks and what to save from which. The workers move the bytes with one umbp batch per
step and direction, and report each operation back, so a block becomes a hit only once every
rank's save of it landed.

Tensor parallelism: every rank keeps its own tiers (``dram_bytes_per_rank`` of DRAM, its own
SSD file) and stores its own shard of each block (its KV heads) in the *same* slot the
scheduler picked, so one index serves all ranks; a block counts as saved when all ranks saved
it, and a load that fails on any rank is reported by that rank (vLLM merges the failed block
ids of all ranks) and recomputed.

Loads: ``load_mode: "async"`` (default) loads a hit between steps, while the request waits
in ``WAITING_FOR_REMOTE_KVS``; ``"layerwise"`` loads it during the step that computes the
rest of the prompt, layer group by layer group (``layers_per_group``), so the forward pass of
the first layers runs while later groups still move (``wait_for_layer_load`` waits for the
layer's group only, or on CUDA queues the wait on vLLM's current stream).

Failures: a block whose object did not land whole on every rank (an I/O error, a bad page, a
deadline) is reported by ``get_block_ids_with_load_errors`` and vLLM recomputes it (set
``"kv_load_failure_policy": "recompute"``, vLLM's default fails the request); it is never
reported loaded, and the index forgets it. Blocks computed over a failed layer-wise load (in
its step, or before vLLM learned of it) are never published: their saves fail whatever the
ranks report, and are planned again from the failed block. A failed save only costs a future
miss.

Checksums: each rank records the CRC32C its save of a block into a slot reported, and its loads
of that slot verify it (the ``checksums`` key: by default the SSD tier's blocks, hashed as they
pass host memory; ``"all_tiers"`` adds DRAM, at the cost docs/VLLM.md gives). A
block whose bytes changed in the tier (a bad sector, another process writing the file) fails as
a load error, counted as ``corrupt_blocks``, and is recomputed, never loaded.

Pool (``"pool"``: ``"redis://..."`` shared by instances and nodes, or ``"embedded"``, a redb
file beside the SSD tier that outlives restarts): the scheduler side's index is the pool's
(:class:`umbp.kvpool.PoolTierIndex`) instead of an in-process one. A hit may then come from
another instance (its SSD file on this host) or from before a restart; each TP rank's shard is
a pool block of its own with its own checksum, published only once every rank's save landed,
and a load leases what it reads (a refused lease is a load error). With a Redis pool and the
memory nodes' secret (``remote_secret_file``), blocks on memory nodes (``umbp-ucx-serve
--pool``) are hits too, loaded over the remote engine, and ``pool_save_to`` (``"local"``,
``"memory_nodes"``, ``"memory_nodes_only"``) sends saves to them; a node that dies or restarts
costs the blocks moving through it (load errors vLLM recomputes, failed saves). ``kv_role``:
``kv_producer`` only saves, ``kv_consumer`` only loads. docs/VLLM.md, "Sharing the cache".

Several KV cache groups (vLLM's hybrid allocator, ``SupportsHMA``: models with
sliding-window layers beside full-attention ones): a block hash names one block per group,
each its own object (keys: the hash in group 0, ``(group, hash)`` in the others). A hit is
what every group can restore: every block of the full-attention groups, and in a
sliding-window group the blocks of the window at the hit's end (vLLM keeps no others; only
blocks vLLM holds are saved or loaded). Loads are async there, and a failed one fails its
request (``failed_recving``): vLLM 0.33 maps no block id back to a request with several
groups. Mamba (SSM) groups are refused (docs/VLLM.md says why).

SSD files: each instance's own (the data-parallel replica and the TP rank are in the default
name, ``{dp_rank}`` and ``{rank}`` place them), held under an exclusive lock while it runs, so
a second instance given the same file stops at start.

See docs/VLLM.md for every extra-config key and the metrics.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import ChecksumPolicy, Engine, FailureKind, Object, Range, Registration, RegistrationError
from .kvpool import (
    REMOTE,
    SAVE_LOCAL,
    SAVE_MEMORY_NODES_ONLY,
    SAVE_TO,
    PoolTierIndex,
    RankRef,
    remote_ref,
)
from .kvtiers import DRAM, SSD, TierIndex

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "UmbpConnector",
    "UmbpConfig",
    "UmbpConnectorMetadata",
    "UmbpWorkerMetadata",
    "UmbpConnectorStats",
    "UmbpPromMetrics",
]

logger = init_logger(__name__)

#: Slots start on this boundary in the tiers, so an SSD slot is aligned for O_DIRECT.
SLOT_ALIGN = 4096

#: Objects are paged in the tiers by at most this much: the SSD engine moves a fragment of
#: at most its maximum segment (1 MiB) at once.
TIER_PAGE = 1 << 20

_LOAD_MODES = ("async", "layerwise")


# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class UmbpConfig:
    """The ``kv_connector_extra_config`` keys (docs/VLLM.md explains each)."""

    dram_bytes_per_rank: int = 4 << 30
    ssd_path: Optional[str] = None
    ssd_bytes_per_rank: int = 0
    ssd_direct: bool = True
    layers_per_group: int = 4
    load_mode: str = "async"
    dram_free_fraction: float = 0.05
    save_decode: bool = False
    load_timeout_s: Optional[float] = None
    engine_workers: int = 8
    checksums: str = "files_and_remote"
    pool: Optional[str] = None
    pool_node: Optional[int] = None
    pool_namespace: Optional[str] = None
    pool_lease_s: float = 30.0
    pool_reserve_s: float = 120.0
    pool_announce_s: float = 15.0
    pool_save_to: str = SAVE_LOCAL
    remote_secret_file: Optional[str] = None
    remote_transports: Optional[str] = None

    @staticmethod
    def from_extra(extra: Optional[Dict[str, Any]]) -> "UmbpConfig":
        """Parses and checks the extra config; an unknown key or a bad value raises
        ``ValueError`` naming it (a typo must not silently fall back to a default)."""
        extra = dict(extra or {})
        known = set(UmbpConfig.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"UmbpConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        cfg = UmbpConfig(**extra)
        if not isinstance(cfg.dram_bytes_per_rank, int) or cfg.dram_bytes_per_rank < 0:
            raise ValueError("UmbpConnector: dram_bytes_per_rank must be a non-negative integer")
        if not isinstance(cfg.ssd_bytes_per_rank, int) or cfg.ssd_bytes_per_rank < 0:
            raise ValueError("UmbpConnector: ssd_bytes_per_rank must be a non-negative integer")
        if cfg.ssd_bytes_per_rank and not cfg.ssd_path:
            raise ValueError("UmbpConnector: ssd_bytes_per_rank needs ssd_path")
        if cfg.ssd_path and not cfg.ssd_bytes_per_rank:
            raise ValueError("UmbpConnector: ssd_path needs ssd_bytes_per_rank")
        if not isinstance(cfg.layers_per_group, int) or cfg.layers_per_group < 1:
            raise ValueError("UmbpConnector: layers_per_group must be a positive integer")
        if cfg.load_mode not in _LOAD_MODES:
            raise ValueError(f"UmbpConnector: load_mode must be one of {_LOAD_MODES}")
        if not 0.0 <= float(cfg.dram_free_fraction) < 1.0:
            raise ValueError("UmbpConnector: dram_free_fraction must lie in [0, 1)")
        if cfg.load_timeout_s is not None and not float(cfg.load_timeout_s) > 0:
            raise ValueError("UmbpConnector: load_timeout_s must be positive")
        policies = [p.value for p in ChecksumPolicy]
        if cfg.checksums not in policies:
            raise ValueError(f"UmbpConnector: checksums must be one of {policies}")
        if cfg.pool is not None:
            if not isinstance(cfg.pool, str) or not cfg.pool:
                raise ValueError("UmbpConnector: pool must be 'embedded', a path or a redis:// URL")
            if cfg.pool == "embedded" and not cfg.ssd_path:
                raise ValueError(
                    "UmbpConnector: the embedded pool lies beside the SSD tier: it needs ssd_path"
                )
            if cfg.checksums == ChecksumPolicy.OFF.value:
                raise ValueError(
                    "UmbpConnector: a pool records each block's checksum: checksums cannot be off"
                )
        if cfg.pool_node is not None and not (
            isinstance(cfg.pool_node, int) and 0 <= cfg.pool_node < 1 << 32
        ):
            raise ValueError("UmbpConnector: pool_node must be an integer in [0, 2**32)")
        for name in ("pool_lease_s", "pool_reserve_s", "pool_announce_s"):
            if not float(getattr(cfg, name)) > 0:
                raise ValueError(f"UmbpConnector: {name} must be positive")
        if cfg.pool_save_to not in SAVE_TO:
            raise ValueError(f"UmbpConnector: pool_save_to must be one of {SAVE_TO}")
        if cfg.pool_save_to != SAVE_LOCAL:
            if cfg.pool is None or "://" not in cfg.pool:
                raise ValueError(
                    "UmbpConnector: memory nodes join a Redis pool: pool_save_to "
                    f"{cfg.pool_save_to!r} needs \"pool\": \"redis://...\""
                )
            if not cfg.memory_nodes():
                raise ValueError(
                    f"UmbpConnector: pool_save_to {cfg.pool_save_to!r} needs the memory nodes' "
                    "shared secret: remote_secret_file, or the UMBP_UCX_SECRET environment "
                    "variable"
                )
        if cfg.remote_secret_file is not None and not os.path.isfile(cfg.remote_secret_file):
            raise ValueError(
                f"UmbpConnector: remote_secret_file {cfg.remote_secret_file!r} is not a file"
            )
        return cfg

    def memory_nodes(self) -> bool:
        """Whether the connector reaches the memory nodes of its pool: a Redis pool, and the
        nodes' shared secret (``remote_secret_file``, or ``UMBP_UCX_SECRET``). Their blocks
        are then hits, and the workers connect to them."""
        return (
            self.pool is not None
            and "://" in self.pool
            and (self.remote_secret_file is not None or bool(os.environ.get("UMBP_UCX_SECRET")))
        )

    def remote_secret(self) -> Optional[bytes]:
        """The memory nodes' secret from ``remote_secret_file`` (one trailing newline dropped,
        as the node reads its own), or None: the engine reads ``UMBP_UCX_SECRET``."""
        if self.remote_secret_file is None:
            return None
        with open(self.remote_secret_file, "rb") as f:
            secret = f.read()
        return secret[:-1] if secret.endswith(b"\n") else secret

    def engine_checksums(self) -> str:
        """The workers' checksum policy: a pool publishes every block with its checksum, so
        with a pool whose blocks go to DRAM (no SSD tier) DRAM is hashed too."""
        if self.pool is not None and not self.ssd_path:
            return ChecksumPolicy.ALL_TIERS.value
        return self.checksums

    def pool_file(self, dp_rank: int = 0) -> Optional[str]:
        """The embedded pool's redb file: beside the SSD tier, one per data-parallel replica
        (``"pool": "embedded"``), or the path given."""
        if self.pool is None or "://" in self.pool:
            return None
        if self.pool != "embedded":
            return self.pool.replace("{dp_rank}", str(dp_rank))
        base = self.ssd_file(0, 1, dp_rank)
        assert base is not None
        return base.replace("{rank}", "all") + ".pool.redb"

    def ssd_file(self, rank: int, ranks: int, dp_rank: int = 0) -> Optional[str]:
        """The SSD file of tensor-parallel rank ``rank`` (of ``ranks``) in data-parallel
        replica ``dp_rank``: ``{dp_rank}`` and ``{rank}`` in ``ssd_path`` are replaced by
        them; without ``{dp_rank}``, ``.dp<d>`` is appended for a replica other than 0, and
        without ``{rank}``, ``.rank<r>`` when there is more than one rank. So replicas and
        ranks given one ``ssd_path`` get files of their own."""
        if not self.ssd_path:
            return None
        path = self.ssd_path
        if "{dp_rank}" in path:
            path = path.replace("{dp_rank}", str(dp_rank))
        elif dp_rank:
            path = f"{path}.dp{dp_rank}"
        if "{rank}" in path:
            return path.replace("{rank}", str(rank))
        return path if ranks == 1 else f"{path}.rank{rank}"


@dataclass(frozen=True)
class _Layout:
    """What one block is on one rank: ``layers`` pages of ``page_bytes``, in the order of the
    KV cache group's layer names; ``slot_bytes`` is its slot in a tier (aligned).

    With several KV cache groups (vLLM's hybrid allocator), a block hash names one block per
    group, each an object of its own: this layout is group 0's, and ``groups`` holds every
    group's (each with ``window``: the tokens a sliding-window group attends back, None for
    full attention). Slots are sized for the largest group's object."""

    layer_names: Tuple[str, ...]
    page_bytes: int
    block_size: int
    num_blocks: int
    window: Optional[int] = None
    #: Tokens a sliding-window group keeps below its window (vLLM's extra_retained_tokens).
    retained: int = 0
    groups: Tuple["_Layout", ...] = ()

    @property
    def object_bytes(self) -> int:
        return len(self.layer_names) * self.page_bytes

    @property
    def slot_bytes(self) -> int:
        size = max([self.object_bytes] + [g.object_bytes for g in self.groups])
        return -(-size // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def all_groups(self) -> Tuple["_Layout", ...]:
        return self.groups or (self,)

    def first_kept(self, tokens: int) -> int:
        """The first block this group keeps once ``tokens`` tokens are computed: vLLM frees
        (and replaces by its null block) a sliding-window group's blocks wholly below the
        window of the next token; a full-attention group keeps every block."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.retained) // self.block_size

    @staticmethod
    def of(kv_cache_config: "KVCacheConfig") -> "_Layout":
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            return _Layout._hybrid(kv_cache_config)
        spec = groups[0].kv_cache_spec
        page = getattr(spec, "page_size_bytes", None)
        if not page or not getattr(spec, "block_size", None):
            raise NotImplementedError(
                f"UmbpConnector cannot store a {type(spec).__name__} KV cache"
            )
        return _Layout(
            tuple(groups[0].layer_names),
            int(page),
            int(spec.block_size),
            int(kv_cache_config.num_blocks),
        )

    @staticmethod
    def _hybrid(kv_cache_config: "KVCacheConfig") -> "_Layout":
        """Several KV cache groups (vLLM's hybrid allocator): full-attention and
        sliding-window groups of one block size. Mamba (SSM) groups and chunked local
        attention are refused (docs/VLLM.md, "vLLM features", says why)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        out = []
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            window: Optional[int] = None
            retained = 0
            if isinstance(spec, SlidingWindowSpec):
                window, retained = int(spec.sliding_window), int(spec.extra_retained_tokens)
            elif not isinstance(spec, FullAttentionSpec):
                raise NotImplementedError(
                    f"UmbpConnector stores full-attention and sliding-window KV cache groups; "
                    f"group {i} is a {type(spec).__name__} (its blocks are not the KV of a "
                    "prefix's tokens: docs/VLLM.md, 'vLLM features'); run without this "
                    "connector, or with --disable-hybrid-kv-cache-manager where the model "
                    "allows it"
                )
            page = getattr(spec, "page_size_bytes", None)
            if not page or not getattr(spec, "block_size", None):
                raise NotImplementedError(
                    f"UmbpConnector cannot store a {type(spec).__name__} KV cache"
                )
            out.append(
                _Layout(
                    tuple(group.layer_names),
                    int(page),
                    int(spec.block_size),
                    int(kv_cache_config.num_blocks),
                    window,
                    retained,
                )
            )
        sizes = sorted({g.block_size for g in out})
        if len(sizes) != 1:
            raise NotImplementedError(
                f"UmbpConnector needs one block size in every KV cache group; these have {sizes}"
            )
        return replace(out[0], groups=tuple(out))


def _dp_rank(vllm_config: "VllmConfig") -> int:
    """This engine's data-parallel replica. vLLM runs each replica of a dense model as an
    engine of its own with ``data_parallel_rank`` reset to 0; ``data_parallel_index`` keeps
    the replica's rank in both cases."""
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))


def _tp(vllm_config: "VllmConfig") -> Tuple[int, int]:
    """(this worker's tensor-parallel rank, the tensor-parallel size)."""
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    rank = 0
    if size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    return rank, size


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
    from ._native import PoolIndex

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
        # Stable across restarts where the instance has an SSD tier (its blocks outlive it).
        seed = f"{socket.gethostname()}|" + (
            "|".join(ssd_files) if ssd_files else f"{os.getpid()}|{dp}|{time.time_ns()}"
        )
        node = int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=4).digest(), "big")
    slot = layout.slot_bytes
    # A password in UMBP_POOL_PASSWORD keeps it off the command line (it overrides the URL's).
    client = PoolIndex(target, password=os.environ.get("UMBP_POOL_PASSWORD") or None)
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


# -- metadata between the two sides ---------------------------------------------------------

#: One block to move: (operation id, tier, slot, GPU block id).
Item = Tuple[int, str, int, int]


@dataclass
class UmbpConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    #: request id -> blocks to load into it.
    loads: Dict[str, List[Item]] = field(default_factory=dict)
    #: request id -> blocks to save from it.
    saves: Dict[str, List[Item]] = field(default_factory=dict)
    #: (operation id, DRAM slot, SSD slot) to copy down.
    demotions: List[Tuple[int, int, int]] = field(default_factory=list)
    #: finished requests whose blocks vLLM keeps until their saves landed (finished_sending).
    hold: List[str] = field(default_factory=list)
    #: requests preempted this step: their blocks are about to be reused.
    preempted: List[str] = field(default_factory=list)
    layerwise: bool = False
    #: With a pool: operation id -> what each rank does (its file, slot and checksum; see
    #: umbp.kvpool.RankRef), for every load and save of this step.
    pool: Dict[int, List[RankRef]] = field(default_factory=dict)
    #: With several KV cache groups: operation id -> the KV cache group whose block it moves
    #: (absent: group 0). A load item with slot -1 (operation 0) is a block that cannot be
    #: loaded (vLLM took less than the hit): it fails, and with it the request's load.
    groups: Dict[int, int] = field(default_factory=dict)


@dataclass
class UmbpWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: how many ranks completed (``ok``) or failed each operation;
    with a pool, the CRC32C each rank's completed save of it wrote (``checksums``: operation
    id -> rank -> checksum), which the scheduler publishes."""

    ok: Dict[int, int] = field(default_factory=dict)
    failed: Dict[int, int] = field(default_factory=dict)
    checksums: Dict[int, Dict[int, int]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "UmbpWorkerMetadata":
        out = UmbpWorkerMetadata(
            dict(self.ok), dict(self.failed), {op: dict(c) for op, c in self.checksums.items()}
        )
        if isinstance(other, UmbpWorkerMetadata):
            for op, n in other.ok.items():
                out.ok[op] = out.ok.get(op, 0) + n
            for op, n in other.failed.items():
                out.failed[op] = out.failed.get(op, 0) + n
            for op, c in other.checksums.items():
                out.checksums.setdefault(op, {}).update(c)
        return out


# -- stats and metrics ----------------------------------------------------------------------

#: Counters a worker reports per interval (``name.tier`` for per-tier ones).
_STAT_NAMES = (
    "loaded_blocks",
    "loaded_bytes",
    "load_errors",
    "saved_blocks",
    "saved_bytes",
    "save_errors",
    "demoted_blocks",
    "demote_errors",
    "corrupt_blocks",
)


@dataclass
class UmbpConnectorStats(KVConnectorStats):
    """Interval counters of the workers: ``"<counter>.<tier>"`` (loaded_blocks,
    loaded_bytes, load_errors, saved_blocks, saved_bytes, save_errors per tier;
    demoted_blocks, demote_errors) and ``"load_wait_s"``, seconds the forward pass spent
    blocked in ``wait_for_layer_load``. Summed across ranks and steps."""

    data: Dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "UmbpConnectorStats":
        out = UmbpConnectorStats(dict(self.data))
        for k, v in (other.data or {}).items():
            out.add(k, v)
        return out

    def reduce(self) -> Dict[str, float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class UmbpPromMetrics(KVConnectorPromMetrics):
    """The workers' counters as Prometheus counters, in vLLM's own ``/metrics``:
    ``vllm:umbp_<counter>_total{tier=...}`` and ``vllm:umbp_load_wait_seconds_total``."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        metric_types: Dict[Any, Any],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {
            "loaded_blocks": "KV blocks umbp loaded whole into vLLM's KV cache, per tier.",
            "loaded_bytes": "Bytes of the KV blocks umbp loaded, per tier.",
            "load_errors": "KV blocks whose load failed (recomputed by vLLM), per tier.",
            "saved_blocks": "KV blocks umbp saved, per tier.",
            "saved_bytes": "Bytes of the KV blocks umbp saved, per tier.",
            "save_errors": "KV blocks whose save failed (a later miss), per tier.",
            "demoted_blocks": "KV blocks moved from DRAM to SSD.",
            "demote_errors": "KV blocks whose move from DRAM to SSD failed (dropped).",
            "corrupt_blocks": "KV blocks whose bytes in the tier failed their checksum on load "
            "(counted in load_errors too; recomputed), per tier.",
        }
        self._counters: Dict[str, Any] = {
            name: self._counter_cls(
                name=f"vllm:umbp_{name}_total", documentation=doc, labelnames=labelnames + ["tier"]
            )
            for name, doc in docs.items()
        }
        self._wait: Any = self._counter_cls(
            name="vllm:umbp_load_wait_seconds_total",
            documentation="Seconds the forward pass spent blocked waiting for umbp layer loads.",
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues[engine_idx])
        for key, value in (transfer_stats_data or {}).items():
            if key == "load_wait_s":
                self._wait.labels(*labels).inc(value)
                continue
            name, _, tier = key.partition(".")
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*labels, tier or "all").inc(value)


# -- the scheduler side ---------------------------------------------------------------------


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


# -- the worker side ------------------------------------------------------------------------


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
            from . import CUDA

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
        if not self.cfg.memory_nodes():
            return {}
        return dict(
            remote=True,
            remote_transports=self.cfg.remote_transports,
            remote_secret=self.cfg.remote_secret(),
        )

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
            try:
                peer = self._eng().connect(address)
            except Exception as e:
                self._nodes_down[address] = time.monotonic() + 1.0
                logger.warning(
                    "UmbpConnector: cannot reach memory node %s: %s (its blocks fail: loads "
                    "are recomputed, saves dropped)",
                    address,
                    e,
                )
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


# -- the connector --------------------------------------------------------------------------


class UmbpConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over umbp's tiers (see the module documentation). It supports
    vLLM's hybrid allocator (``SupportsHMA``): full-attention and sliding-window KV cache
    groups, each block of each group an object of its own."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("UmbpConnector does not support pipeline parallelism")
        if getattr(parallel, "decode_context_parallel_size", 1) > 1:
            # The scheduler's blocks would span several ranks' KV blocks.
            raise NotImplementedError("UmbpConnector does not support decode context parallelism")
        self.config = UmbpConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        layout = _Layout.of(kv_cache_config)
        if layout.groups and self.config.load_mode != "async":
            # vLLM 0.33 takes a failed load back per request with several groups, and only
            # from a request still waiting for its load (failed_recving): a load that feeds
            # the step computing the rest of the prompt could not fail safely.
            raise NotImplementedError(
                "UmbpConnector: with several KV cache groups (a hybrid or sliding-window model), "
                'load_mode must be "async": vLLM takes a failed load back only from a request '
                "that waits for it"
            )
        sizes = sorted({g.object_bytes for g in layout.all_groups})
        if len(sizes) > 1 and self.config.pool is not None:
            # A pool's blocks have one size (its slots and lookups check it).
            raise NotImplementedError(
                "UmbpConnector: a pool holds blocks of one size; this model's KV cache groups "
                f"make objects of {sizes} bytes (run without \"pool\", or with "
                "--disable-hybrid-kv-cache-manager)"
            )
        rank, ranks = (
            _tp(vllm_config)
            if role == KVConnectorRole.WORKER
            else (0, int(vllm_config.parallel_config.tensor_parallel_size))
        )
        self.scheduler_side: Optional[_SchedulerSide] = None
        self.worker_side: Optional[_WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            kv = self._kv_transfer_config
            self.scheduler_side = _SchedulerSide(
                self.config,
                layout,
                ranks,
                _open_pool(self.config, vllm_config, layout, ranks),
                loads=kv.is_kv_consumer,
                saves=kv.is_kv_producer,
            )
            events = vllm_config.kv_events_config
            if events is not None and events.enable_kv_cache_events:
                self.scheduler_side.enable_events()
        else:
            self.worker_side = _WorkerSide(
                self.config, layout, rank, ranks, kv_cache_config, _dp_rank(vllm_config)
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        # A block's pages must each be one contiguous run (block-compact layouts). vLLM
        # takes this wherever the attention backends support it (VLLM_KV_CACHE_LAYOUT still
        # wins), so a backend whose first choice puts heads outside blocks (ROCm's) gets a
        # layout the connector can move instead of a refusal at start. Where they do not,
        # vLLM keeps their first choice, saying so. MLA caches have one head: any
        # block-compact layout is the same bytes, so they keep vLLM's choice.
        model = vllm_config.model_config
        if model is not None and getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        # Layer-wise loads wait between layers: a full CUDA graph would skip those waits.
        return bool((extra_config or {}).get("load_mode", "async") == "layerwise")

    @property
    def _sched(self) -> _SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("UmbpConnector: a scheduler-side call on a worker's connector")
        return self.scheduler_side

    @property
    def _work(self) -> _WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("UmbpConnector: a worker-side call on the scheduler's connector")
        return self.worker_side

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save lost to a preemption is a later miss, never a wrong token.
        return False

    # -- scheduler side ----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_side is not None:
            self.scheduler_side.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: "Request", num_external_tokens: int
    ) -> Dict[CacheHitSource, int]:
        return self._sched.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched.update(connector_output)

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._sched.finished(request)

    def request_finished_all_groups(
        self, request: "Request", block_ids: Tuple[List[int], ...]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # What is held is decided per request (its saves in flight, of every group).
        return self._sched.finished(request)

    def reset_cache(self) -> Optional[bool]:
        if self.scheduler_side is None:
            return None
        # vLLM resets caches when the KV they hold is no longer right (new weights, sleep):
        # a save in flight was computed before the reset, so it fails whatever the ranks
        # report, and a block being demoted leaves with the rest.
        self._sched.index.clear(in_flight=True)
        return True

    def take_events(self) -> Iterable["KVCacheEvent"]:
        # The scheduler publishes these with its own prefix cache's events.
        return [] if self.scheduler_side is None else self.scheduler_side.take_events()

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self._work.register(kv_caches)

    def unregister_kv_caches(self) -> None:
        # Sleep mode: the transfers touching the KV cache finish, its registrations close.
        if self.worker_side is not None:
            self.worker_side.unregister_kv()

    def restore_kv_caches(self) -> None:
        # Wake-up: the KV cache's memory is back (vLLM keeps its addresses).
        if self.worker_side is not None:
            self.worker_side.restore_kv()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self._work.saves_started = False

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, UmbpConnectorMetadata):
            self._work.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UmbpConnectorMetadata)
        self._work.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # A block is one object of all its layers, and an offload writes objects whole: the
        # step's saves start once, in wait_for_save, after the last layer.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, UmbpConnectorMetadata)
        self._work.start_saves(meta)

    def get_finished(
        self, finished_req_ids: Set[str]
    ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        meta = (
            self._connector_metadata
            if isinstance(self._connector_metadata, UmbpConnectorMetadata)
            else None
        )
        sending, recving = self._work.finished(meta)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        # With several KV cache groups, a failed load fails its request (vLLM 0.33 maps no
        # block id back to a request there): reported with the finished_recving that settles
        # it, and vLLM loads what is left of the hit again (the failed block left the index).
        results.failed_recving = self._work.failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._work.load_errors()

    def build_connector_worker_meta(self) -> Optional[UmbpWorkerMetadata]:
        return self._work.worker_meta()

    def get_kv_connector_stats(self) -> Optional[UmbpConnectorStats]:
        return None if self.worker_side is None else self._work.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> UmbpConnectorStats:
        return UmbpConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: Dict[Any, Any],
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> UmbpPromMetrics:
        return UmbpPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None and self.scheduler_side.pool is not None:
            self.scheduler_side.pool.close()
