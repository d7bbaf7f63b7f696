"""vLLM's engine loop on CPU with :class:`~umbp.vllm.UmbpConnector`, without a GPU or a model.

What ``python -m umbp.vllm.check``, the connector's tests (``tests/vllm_harness.py``) and its
bench (``bench/vllm_connector_bench.py``) drive: vLLM's own v1 ``Scheduler`` with the
connector loaded by module path (as a server loads it), built from a small model
``config.json`` written here (no weights, no tokenizer), and one worker-side connector per
tensor-parallel rank over CPU tensors vLLM's ``allocate_kv_cache`` lays out.

:meth:`EngineHarness.step` drives the workers in the order vLLM's model runner calls them:
``handle_preemptions`` before anything writes the KV cache, then the blocks about to be
loaded are poisoned (only the load can make them right), then bind metadata and start the
loads, per layer ``wait_for_layer_load``, the forward pass and ``save_kv_layer``, then the
end of the step (:func:`connector_output`); the ranks' outputs are aggregated as vLLM's
executor does and handed to the scheduler (:func:`model_runner_output`). What differs
between models (one KV cache group or several, how a block is checked) is a subclass's:
``forward``, ``block_ids``, the hooks ``layer_loaded``, ``check_loads`` and
``check_prefill``. :class:`PrefixModelHarness` is the one-group model whose every byte is a
function of its token's prefix, so each loaded block is checked byte for byte.

Private: its names change with the tests that use it. Needs vLLM 0.33.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple
from unittest import mock

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from .connector import UmbpConnector

BS = 16  # tokens per block
KV_HEADS = 2
HEAD = 16
EOS = 2
POISON = 0xA5

init_none_hash(sha256)


class WrongBytes(AssertionError):
    """A block in the KV cache does not hold what its prefix implies (a load brought other
    bytes, or a block was computed over them)."""


def write_model_dir(root: str, layers: int, *, kv_heads: int = KV_HEADS, head: int = HEAD) -> str:
    """A model directory under ``root`` holding only a Llama ``config.json`` of ``layers``
    layers of ``kv_heads`` KV heads of ``head`` elements (fp16): enough for vLLM's config
    and scheduler, which read no weights."""
    d = os.path.join(root, "model")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": kv_heads * 2 * head,
                "intermediate_size": 128,
                "num_attention_heads": kv_heads * 2,
                "num_key_value_heads": kv_heads,
                "head_dim": head,
                "num_hidden_layers": layers,
                "vocab_size": 1024,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "float16",
                "eos_token_id": EOS,
            },
            f,
        )
    return d


def umbp_transfer_config(
    extra: Dict[str, Any], kv_role: str = "kv_both", **fields: Any
) -> KVTransferConfig:
    """vLLM's ``kv_transfer_config`` loading UmbpConnector by module path with the extra
    config ``extra``, recomputing failed loads (``fields`` override or add vLLM's own
    fields)."""
    args: Dict[str, Any] = dict(
        kv_connector="UmbpConnector",
        kv_connector_module_path="umbp.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    args.update(fields)
    return KVTransferConfig(**args)


def engine_config(
    model: str,
    transfer: KVTransferConfig,
    *,
    block_size: int = BS,
    max_batched: int = 4096,
    max_len: int = 4096,
    layout: str = "LBNHC",
    tp: int = 1,
    kv_events: bool = False,
) -> VllmConfig:
    """vLLM's config of a CPU instance serving ``model`` (see :func:`write_model_dir`) with
    the connector ``transfer`` names, prefix caching on, chunked prefill, the KV cache laid
    out as ``layout``."""
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.kv_cache_layout = layout
    return VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=max_len
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=max_batched,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=cache_config,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
    )


def vllm_config(
    root: Any,
    *,
    layers: int,
    extra: Dict[str, Any],
    max_batched: int = 4096,
    layout: str = "LBNHC",
    tp: int = 1,
    kv_events: bool = False,
    kv_role: str = "kv_both",
) -> VllmConfig:
    """:func:`engine_config` of a model of ``layers`` layers written under ``root`` with
    UmbpConnector (its extra config ``extra``) as ``kv_role``."""
    return engine_config(
        write_model_dir(str(root), layers),
        umbp_transfer_config(extra, kv_role),
        max_batched=max_batched,
        layout=layout,
        tp=tp,
        kv_events=kv_events,
    )


def full_attention_spec(kv_heads: int = KV_HEADS, head: int = HEAD, block_size: int = BS) -> Any:
    """vLLM's KV cache spec of one full-attention layer of the models written here."""
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head, dtype=torch.float16
    )


def new_request(
    rid: str, tokens: Sequence[int], *, block_size: int = BS, max_tokens: int = 1
) -> Request:
    """A vLLM request of prompt ``tokens`` sampling ``max_tokens`` tokens (EOS ignored), its
    blocks hashed as vLLM's engine hashes them (sha256)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def connector_output(
    worker: KVConnectorBase_V1, finished_req_ids: Set[str], *, failed_recving: bool = False
) -> KVConnectorOutput:
    """The end of a step on one worker, in vLLM's model runner's order: ``wait_for_save``,
    the transfer results, the blocks whose loads failed, stats and worker metadata, then the
    metadata cleared. ``failed_recving``: report the requests whose loads failed too (as
    vLLM's runner does; a connector with one KV cache group reports blocks instead)."""
    worker.wait_for_save()  # type: ignore[no-untyped-call]
    results = worker.get_transfer_results(finished_req_ids)
    output = KVConnectorOutput(
        finished_sending=results.finished_sending or None,
        finished_recving=results.finished_recving or None,
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_stats=worker.get_kv_connector_stats(),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
        failed_recving=set(results.failed_recving) if failed_recving else set(),
    )
    worker.clear_connector_metadata()
    return output


def model_runner_output(
    req_ids: List[str], sampled: List[List[int]], kv_output: KVConnectorOutput
) -> ModelRunnerOutput:
    """What vLLM's model runner returns for a step that computed ``req_ids`` (``sampled``:
    each one's sampled tokens, none for a prefill not finished yet) with the connector's
    output ``kv_output``."""
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_output,
    )


def prompt(seed: int, n: int) -> List[int]:
    """``n`` token ids drawn from ``seed``."""
    return [int(x) for x in np.random.default_rng(seed).integers(3, 1000, n)]


@dataclass
class Rank:
    """One tensor-parallel worker: its connector and its KV cache (views, and as bytes)."""

    rank: int
    worker: UmbpConnector
    kv: Dict[str, torch.Tensor]
    kv8: Dict[str, torch.Tensor]


def first_step_of(h: "EngineHarness", rid: str) -> Tuple[Any, int]:
    """Steps until ``rid`` is scheduled; returns (scheduler output, its computed tokens)."""
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        so = h.idle_step()
        for req in so.scheduled_new_reqs:
            if req.req_id == rid:
                return so, int(req.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        if rid in cached.req_ids:
            return so, int(cached.num_computed_tokens[cached.req_ids.index(rid)])
    raise TimeoutError(f"{rid} never scheduled")


#: (request, KV cache group, block index, GPU block) of one block loaded in a step.
Load = Tuple[str, int, int, int]


class EngineHarness:
    """vLLM's scheduler with UmbpConnector, one worker-side connector per tensor-parallel
    rank over CPU tensors, and a fake forward pass (the subclass's ``forward``).

    The subclass sets ``self.layers`` (every layer's name, in the forward pass's order) and
    ``self.groups`` (each KV cache group's layer names), builds the scheduler's config and KV
    cache config, and calls ``_start``."""

    #: Whether the workers' failed receives are reported to the scheduler.
    report_failed_recving = False
    #: Whether ``close`` shuts the scheduler-side connector down too.
    close_scheduler_side = False

    layers: List[str]
    groups: List[List[str]]

    def _start(
        self, config: VllmConfig, kv_cache_config: KVCacheConfig, num_blocks: int, tp: int
    ) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config
        assert kv_cache_config.num_blocks == num_blocks
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=config.cache_config.block_size,
            log_stats=True,
        )
        connector: Any = self.scheduler.connector
        assert type(connector).__name__ == "UmbpConnector"
        self.sched_side = connector.scheduler_side
        self.index = self.sched_side.index
        # One worker per tensor-parallel rank, each with its KV cache exactly as vLLM's model
        # runner allocates it for this layout (its shard of the heads).
        self.tp = tp
        self.ranks: List[Rank] = []
        for rank in range(tp):
            kv = allocate_kv_cache(
                kv_cache_config,
                torch.device("cpu"),
                config.cache_config.get_resolved_kv_cache_layout(),
            )
            # No torch.distributed group here: each worker is told its rank.
            with mock.patch("umbp.vllm.connector._tp", return_value=(rank, tp)):
                worker = UmbpConnector(config, KVConnectorRole.WORKER, kv_cache_config)
            worker.register_kv_caches(kv)
            kv8 = {name: t.view(torch.uint8) for name, t in kv.items()}
            self.ranks.append(Rank(rank, worker, kv, kv8))
        self.worker, self.kv, self.kv8 = self.ranks[0].worker, self.ranks[0].kv, self.ranks[0].kv8
        self.token_bytes = self.kv8[self.layers[0]][0, :, 0, :].numel()
        self.aggregator = KVOutputAggregator(tp)
        self.requests: Dict[str, Request] = {}
        self.steps = 0
        self.load_errors: Set[int] = set()
        self.stats: Dict[str, float] = {}
        self.step_stats: List[Any] = []
        self.prefills_checked = 0
        self.first_computed: Dict[str, int] = {}
        self.computed_wrong = 0  # (request, layer) forward passes over a wrong prefix
        self._expected: Dict[Any, Any] = {}  # the model's memo of each token's right bytes

    # -- the model -------------------------------------------------------------------------

    def token_kv(self, tokens: Sequence[int], pos: int, layer: int, rank: int = 0) -> Any:
        """The bytes of token ``pos``'s KV in ``layer`` on ``rank``: a function of its whole
        prefix (and of the rank, whose shard of the heads it is)."""
        h = hashlib.blake2b(
            repr((tuple(tokens[: pos + 1]), layer, rank)).encode(), digest_size=8
        ).digest()
        rng = np.random.default_rng(int.from_bytes(h, "little"))
        return rng.integers(0, 256, self.token_bytes, dtype=np.uint8)

    def forward(self, rank: int, layer: int, rid: str, start: int, end: int) -> None:
        """Computes tokens ``start..end-1`` of ``rid`` in layer ``layer`` (its position in
        ``self.layers``) on ``rank``."""
        raise NotImplementedError

    # -- hooks of one step -----------------------------------------------------------------

    def layer_loaded(
        self, r: Rank, layer: int, so: Any, loads: List[Load], check_loads: bool
    ) -> None:
        """Called on rank ``r`` when its wait for ``layer``'s load returned, before the
        forward pass reads it."""

    def check_loads(
        self, so: Any, output: KVConnectorOutput, loads: List[Load], check_loads: bool
    ) -> None:
        """Called once the ranks' outputs are aggregated: checks the loads that settled."""

    def check_prefill(self, rid: str, req: Request) -> None:
        """Called when ``rid``'s prefill completed with no block of it failed."""

    # -- requests --------------------------------------------------------------------------

    def add(self, rid: str, tokens: Sequence[int], max_tokens: int = 1) -> Request:
        """Adds a request of prompt ``tokens`` to the scheduler."""
        req = new_request(
            rid, tokens, block_size=self.config.cache_config.block_size, max_tokens=max_tokens
        )
        self.requests[rid] = req
        self.scheduler.add_request(req)
        return req

    # -- one engine step, in the model runner's order ----------------------------------------

    def _poison_loads(self, meta: Any) -> List[Load]:
        """The step's loads; their blocks hold poison on every rank, so only the load can
        make them right."""
        loads = []
        for rid, items in meta.loads.items():
            for op, _, _, block in items:
                group = meta.groups.get(op, 0)
                index = self.scheduler.kv_cache_manager.get_block_ids(rid)[group].index(block)
                loads.append((rid, group, index, block))
                for r in self.ranks:
                    for layer in self.groups[group]:
                        r.kv8[layer][block] = POISON
        return loads

    def step(self, check_loads: bool = True) -> Any:
        """One engine step: schedule, the workers in the model runner's order, the ranks'
        outputs aggregated and handed back to the scheduler. Returns the scheduler output."""
        so: Any = self.scheduler.schedule()
        meta: Any = so.kv_connector_metadata
        # First, as vLLM's model runner: nothing writes the KV cache before it (a preempted
        # request's blocks, or blocks freed this step, about to be reused, may still be read
        # by an earlier step's save).
        for r in self.ranks:
            r.worker.handle_preemptions(meta)
        loads = self._poison_loads(meta)
        for r in self.ranks:
            r.worker.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                r.worker.start_load_kv(None)  # type: ignore[arg-type]
        scheduled = []
        for req in so.scheduled_new_reqs:
            scheduled.append((req.req_id, req.num_computed_tokens))
            self.first_computed.setdefault(req.req_id, req.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            scheduled.append((rid, cached.num_computed_tokens[i]))
        for layer, name in enumerate(self.layers):
            for r in self.ranks:
                r.worker.wait_for_layer_load(name)
                self.layer_loaded(r, layer, so, loads, check_loads)
                for rid, computed in scheduled:
                    end = computed + so.num_scheduled_tokens[rid]
                    self.forward(r.rank, layer, rid, computed, end)
                r.worker.save_kv_layer(name, r.kv[name], None)
        req_ids = [rid for rid, _ in scheduled]
        sampled = []
        for rid, computed in scheduled:
            done = computed + so.num_scheduled_tokens[rid] >= self.requests[rid].num_tokens
            sampled.append([7] if done else [])
        outputs: List[Optional[ModelRunnerOutput]] = []
        for r in self.ranks:
            if not so.has_sync_kv_loads:
                r.worker.start_load_kv(None)  # type: ignore[arg-type]
            output = connector_output(
                r.worker, so.finished_req_ids, failed_recving=self.report_failed_recving
            )
            outputs.append(model_runner_output(req_ids, sampled, output))
        # What vLLM's executor hands the scheduler: the ranks' outputs aggregated.
        merged: Any = self.aggregator.aggregate(outputs) if self.tp > 1 else outputs[0]
        output = merged.kv_connector_output
        invalid = output.invalid_block_ids
        self.load_errors |= invalid
        stats: Any = output.kv_connector_stats
        if stats is not None:
            self.step_stats.append(stats)
            for k, v in stats.data.items():
                self.stats[k] = self.stats.get(k, 0) + v
        self.check_loads(so, output, loads, check_loads)
        for rid, computed in scheduled:
            request = self.requests[rid]
            done = computed + so.num_scheduled_tokens[rid] >= request.num_tokens
            if done and computed < request.num_prompt_tokens and not self._held(rid) & invalid:
                self.check_prefill(rid, request)
                self.prefills_checked += 1
        self.scheduler.update_from_output(so, merged)
        self.steps += 1
        return so

    def _held(self, rid: str) -> Set[int]:
        """Every GPU block ``rid`` holds, in every KV cache group."""
        return {b for ids in self.scheduler.kv_cache_manager.get_block_ids(rid) for b in ids}

    def idle_step(self) -> Any:
        """One step; a step that computed nothing (loads and saves still moving) waits a
        millisecond, as an engine with nothing to run does not spin this hard."""
        so = self.step()
        if so.total_num_scheduled_tokens == 0:
            time.sleep(0.001)
        return so

    def run(self, hang: float = 120.0) -> None:
        """Steps until every request finished and every block went back; ``hang`` seconds
        only tell a hang (a lost completion) from slow I/O."""
        deadline = time.monotonic() + hang
        while self.scheduler.requests or self.index.pending_ops():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"hung: {list(self.scheduler.requests)}")
            self.idle_step()

    def first_step_of(self, rid: str) -> Tuple[Any, int]:
        """Steps until ``rid`` is scheduled (:func:`first_step_of`)."""
        return first_step_of(self, rid)

    def close(self) -> None:
        """Shuts the workers down (and the scheduler side, ``close_scheduler_side``)."""
        for r in self.ranks:
            r.worker.shutdown()
        if self.close_scheduler_side:
            connector: Any = self.scheduler.connector
            connector.shutdown()


class PrefixModelHarness(EngineHarness):
    """One KV cache group of ``layers`` full-attention layers and a model whose bytes are a
    function of each token's prefix: every loaded block is compared byte for byte with what
    its prefix implies once its load settled on every rank.

    As in a real model, layer L of a computed token depends on layer L-1's KV of its prefix
    as it lies in the cache: where that holds anything but what the prefix implies (a block
    whose load failed), layer L is computed wrong too, so a block computed over a failed load
    is wrong bytes that a later load would serve. ``extra`` is the connector's extra config."""

    def __init__(
        self,
        root: Any,
        *,
        layers: int = 4,
        num_blocks: int = 256,
        layout: str = "LBNHC",
        max_batched: int = 4096,
        kv_heads: int = KV_HEADS,
        head: int = HEAD,
        tp: int = 1,
        kv_events: bool = False,
        kv_role: str = "kv_both",
        transfer: Optional[Dict[str, Any]] = None,
        **extra: Any,
    ):
        extra.setdefault("dram_bytes_per_rank", 64 << 20)
        self.extra = extra
        config = engine_config(
            write_model_dir(str(root), layers, kv_heads=kv_heads, head=head),
            umbp_transfer_config(extra, kv_role, **(transfer or {})),
            max_batched=max_batched,
            layout=layout,
            tp=tp,
            kv_events=kv_events,
        )
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.groups = [self.layers]
        spec = full_attention_spec(kv_heads, head)
        self.kv_heads = kv_heads
        self.page_bytes = int(spec.page_size_bytes)
        kv_cache_config = get_kv_cache_config_from_groups(
            config,
            [KVCacheGroupSpec(self.layers, spec)],
            available_memory=num_blocks * layers * spec.page_size_bytes,
        )
        self._start(config, kv_cache_config, num_blocks, tp)
        self.loaded: List[List[Any]] = []  # [request, GPU block, failed] of loads not settled
        self.checked_loads = 0
        self.verified_bytes = 0  # bytes of the loaded blocks compared, every rank's

    def expected_rows(self, rid: str, rank: int, layer: int, n: int) -> Any:
        """The rows tokens 0..n-1 of ``rid`` hold in ``layer`` on ``rank`` when right, as a
        (n, token_bytes) array (memoized: a token's bytes never change)."""
        key = (rid, rank, layer)
        rows = self._expected.get(key)
        have = 0 if rows is None else len(rows)
        if have < n:
            tokens = self.requests[rid].all_token_ids
            more = np.stack([self.token_kv(tokens, p, layer, rank) for p in range(have, n)])
            rows = more if rows is None else np.concatenate([rows, more])
            self._expected[key] = rows
        assert rows is not None
        return rows[:n]

    def cache_rows(
        self, rank: int, layer: int, block_ids: Sequence[int], start: int, end: int
    ) -> Any:
        """Rows ``start..end-1`` of a request (its blocks ``block_ids``) in ``layer``, as they
        lie in the cache of ``rank``."""
        bs = self.config.cache_config.block_size
        pos = np.arange(start, end)
        blocks = np.asarray(block_ids)[pos // bs]
        rows = self.ranks[rank].kv8[self.layers[layer]].numpy()[blocks, :, pos % bs, :]
        return rows.reshape(end - start, -1)

    def prefix_is_right(self, rid: str, rank: int, layer: int, n: int) -> bool:
        """Whether tokens 0..n-1 of ``rid`` hold what their prefix implies in ``layer``."""
        if n == 0:
            return True
        got = self.cache_rows(rank, layer, self.block_ids(rid), 0, n)
        return bool(np.array_equal(got, self.expected_rows(rid, rank, layer, n)))

    def forward(self, rank: int, layer: int, rid: str, start: int, end: int) -> None:
        """Computes tokens ``start..end-1`` of ``rid`` in ``layer`` on ``rank``: right when
        layer L-1 of the prefix before them holds what it should (tokens start..end-1 of
        layer L-1 were computed by this step, right or wrong alike), wrong otherwise."""
        bs = self.config.cache_config.block_size
        r = self.ranks[rank]
        name = self.layers[layer]
        rows = self.expected_rows(rid, rank, layer, end)[start:end]
        if layer > 0 and not self.prefix_is_right(rid, rank, layer - 1, start):
            rows = rows ^ 0x5A  # what attention over wrong KV yields: wrong KV in turn
            self.computed_wrong += 1
        pos = np.arange(start, end)
        ids = np.asarray(self.block_ids(rid))[pos // bs]
        cache = r.kv8[name].numpy()  # the tensor's own bytes
        cache[ids, :, pos % bs, :] = rows.reshape(end - start, *cache.shape[1:2], -1)

    def block_ids(self, rid: str) -> List[int]:
        """``rid``'s GPU blocks."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def block_is_right(
        self,
        rid: str,
        index: int,
        block_id: Optional[int] = None,
        layers: Optional[Iterable[int]] = None,
        ranks: Optional[Iterable[int]] = None,
    ) -> bool:
        """Whether block ``index`` of ``rid`` (in GPU block ``block_id``, by default the one
        it holds) is what its prefix implies in ``layers`` on ``ranks`` (default: all)."""
        bs = self.config.cache_config.block_size
        block_id = self.block_ids(rid)[index] if block_id is None else block_id
        start, end = index * bs, (index + 1) * bs
        wanted = None if layers is None else set(layers)
        for r in self.ranks if ranks is None else [self.ranks[k] for k in ranks]:
            for layer in range(len(self.layers)):
                if wanted is not None and layer not in wanted:
                    continue
                want = self.expected_rows(rid, r.rank, layer, end)[start:end]
                got = self.cache_rows(r.rank, layer, [block_id] * (index + 1), start, end)
                if not np.array_equal(want, got):
                    return False
        return True

    def failing(self, rid: str, block: int, rank: int = 0) -> bool:
        """Whether the load of ``block`` failed on ``rank`` (known once the step's load
        settled)."""
        side = self.ranks[rank].worker.worker_side
        t = None if side is None else side._step_load
        if t is None:
            return False
        for k, (_, _, _, b) in enumerate(t.items):
            if b == block and t.requests[k] == rid:
                return bool(t.batch.wait().objects[k].state != "completed")
        return False

    # -- the checks of one step (EngineHarness.step calls them) ------------------------------

    def layer_loaded(
        self, r: Rank, layer: int, so: Any, loads: List[Load], check_loads: bool
    ) -> None:
        if so.has_sync_kv_loads and check_loads:
            # Attention of this layer reads the loaded prefix now: its pages must have
            # landed (a failed block is reported at the end of the step).
            for rid, _, index, block in loads:
                if not (
                    self.block_is_right(rid, index, layers={layer}, ranks=[r.rank])
                    or self.failing(rid, block, r.rank)
                ):
                    raise WrongBytes(
                        f"{rid}: layer {layer} of block {index} not loaded on rank "
                        f"{r.rank} when its wait returned"
                    )

    def check_loads(
        self, so: Any, output: KVConnectorOutput, loads: List[Load], check_loads: bool
    ) -> None:
        invalid = output.invalid_block_ids
        for rid, _, _, block in loads:
            self.loaded.append([rid, block, False])
        for x in self.loaded:  # a rank may report a failure before the others settle
            x[2] = x[2] or x[1] in invalid
        # A load that settled on every rank is checked now, before anything overwrites its
        # blocks: each block is either reported failed or holds exactly its prefix's bytes.
        if check_loads:
            settled = set(output.finished_recving or set()) | {
                rid for rid, *_ in loads if so.has_sync_kv_loads
            }
            for rid, block, failed in [x for x in self.loaded if x[0] in settled]:
                if failed:
                    continue
                index = self.block_ids(rid).index(block)
                if not self.block_is_right(rid, index):
                    raise WrongBytes(f"{rid}: block {index} (GPU block {block}) restored wrong")
                self.checked_loads += 1
                self.verified_bytes += self.tp * len(self.layers) * self.page_bytes
            self.loaded = [x for x in self.loaded if x[0] not in settled]

    def check_prefill(self, rid: str, req: Request) -> None:
        # The prefill is complete: loaded and computed blocks together hold exactly what
        # the prompt implies, on every rank.
        for index in range(req.num_prompt_tokens // self.config.cache_config.block_size):
            if not self.block_is_right(rid, index):
                raise WrongBytes(f"{rid}: block {index} wrong after prefill")
