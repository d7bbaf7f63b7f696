"""The connector's configuration: :class:`UmbpConfig`, parsed from vLLM's
``kv_connector_extra_config`` (docs/VLLM.md explains each key), and where this instance sits
in vLLM's parallel layout (its data-parallel replica and tensor-parallel rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import ChecksumPolicy
from ..kvpool import SAVE_LOCAL, SAVE_TO

if TYPE_CHECKING:
    from vllm.config import VllmConfig


_LOAD_MODES = ("async", "layerwise")


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
    remote_connect_wait_s: float = 0.05

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
        if not float(cfg.remote_connect_wait_s) >= 0:
            raise ValueError("UmbpConnector: remote_connect_wait_s must be a number >= 0")
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
