""":class:`UmbpConnector`, the class vLLM loads: one scheduler side or one worker side,
by role (see the package documentation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import UmbpConfig, _dp_rank, _tp
from .layout import _Layout
from .metadata import UmbpConnectorMetadata, UmbpWorkerMetadata
from .scheduler import _SchedulerSide, _open_pool
from .stats import UmbpConnectorStats, UmbpPromMetrics
from .worker import _WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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
