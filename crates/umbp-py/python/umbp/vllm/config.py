"""The connector's configuration: :class:`UmbpConfig`, parsed from vLLM's
``kv_connector_extra_config`` (docs/VLLM.md explains each key), and where this instance sits
in vLLM's parallel layout (its data-parallel replica and tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from .. import ChecksumPolicy
from ..poolkeys import PoolKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig


_LOAD_MODES = ("async", "layerwise")


@dataclass(frozen=True)
class UmbpConfig(PoolKeys):
    """The ``kv_connector_extra_config`` keys (docs/VLLM.md explains each; the pool's keys are
    :class:`umbp.poolkeys.PoolKeys`, shared with the SGLang backend)."""

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

    @staticmethod
    def from_extra(extra: Optional[Dict[str, Any]]) -> "UmbpConfig":
        """Parses and checks the extra config; an unknown key or a bad value raises
        ``ValueError`` naming it (a typo must not silently fall back to a default)."""
        extra = dict(extra or {})
        UmbpConfig.refuse_unknown(extra, "UmbpConnector: unknown kv_connector_extra_config")
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
        cfg.check_pool_keys("UmbpConnector", ssd_path=cfg.ssd_path, checksums=cfg.checksums)
        return cfg

    def engine_checksums(self) -> str:
        """The workers' checksum policy: a pool publishes every block with its checksum, so
        with a pool whose blocks go to DRAM (no SSD tier) DRAM is hashed too."""
        return self.pool_checksums(self.checksums, durable=bool(self.ssd_path))

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
