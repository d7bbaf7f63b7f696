"""The workers' interval counters (:class:`UmbpConnectorStats`) and their Prometheus
counters in vLLM's ``/metrics`` (:class:`UmbpPromMetrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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
