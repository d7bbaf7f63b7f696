"""The engine harness test_vllm.py, test_vllm_hma.py and test_vllm_pool.py share: vLLM's own
v1 Scheduler with umbp.vllm.UmbpConnector loaded by module path (as a server loads it), built
from a small model config.json written here (no weights, no tokenizer), and one worker-side
connector per tensor-parallel rank over CPU tensors vLLM's ``allocate_kv_cache`` lays out.

``EngineHarness.step`` drives the workers in the order vLLM's model runner calls them:
``handle_preemptions`` before anything writes the KV cache, then the blocks about to be
loaded are poisoned (only the load can make them right), then bind metadata and start the
loads, per layer ``wait_for_layer_load``, the forward pass and ``save_kv_layer``, then
``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors`` and the worker
metadata; the ranks' outputs are aggregated as vLLM's executor does and handed to the
scheduler. What differs between the test files (one KV cache group or several, how a block
is checked) is the subclass's: ``forward``, ``block_ids``, the hooks ``layer_loaded``,
``check_loads`` and ``check_prefill``.

Where vLLM is absent, importing this module skips the test module that imports it, with the
reason printed (and fails where UMBP_REQUIRE_VLLM=1): `bash .ci/vllm-venv` installs vLLM.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest

try:
    import torch
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("UMBP_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vLLM is not installed ({e}); run: bash .ci/vllm-venv", allow_module_level=True)

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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from umbp.vllm import UmbpConnector

BS = 16  # tokens per block
KV_HEADS = 2
HEAD = 16
EOS = 2
POISON = 0xA5

init_none_hash(sha256)


def model_dir(tmp_path, layers):
    """A model directory holding only a Llama config.json of ``layers`` layers."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": KV_HEADS * 2 * HEAD,
                "intermediate_size": 128,
                "num_attention_heads": KV_HEADS * 2,
                "num_key_value_heads": KV_HEADS,
                "head_dim": HEAD,
                "num_hidden_layers": layers,
                "vocab_size": 1024,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "float16",
                "eos_token_id": EOS,
            }
        )
    )
    return str(d)


def vllm_config(
    tmp_path,
    *,
    layers,
    extra,
    max_batched=4096,
    layout="LBNHC",
    tp=1,
    kv_events=False,
    kv_role="kv_both",
):
    """vLLM's config of an instance serving the model of ``model_dir`` with UmbpConnector
    (its extra config ``extra``) as ``kv_role``."""
    cache_config = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache_config.kv_cache_layout = layout
    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir(tmp_path, layers),
            skip_tokenizer_init=True,
            dtype="float16",
            seed=0,
            max_model_len=4096,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=max_batched,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=cache_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="UmbpConnector",
            kv_connector_module_path="umbp.vllm",
            kv_role=kv_role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
    )


def prompt(seed, n):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 1000, n)]


@dataclass
class Rank:
    """One tensor-parallel worker: its connector and its KV cache (views, and as bytes)."""

    rank: int
    worker: UmbpConnector
    kv: dict
    kv8: dict


def first_step_of(h, rid):
    """Steps until ``rid`` is scheduled; returns (scheduler output, its computed tokens)."""
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        so = h.idle_step()
        for req in so.scheduled_new_reqs:
            if req.req_id == rid:
                return so, req.num_computed_tokens
        cached = so.scheduled_cached_reqs
        if rid in cached.req_ids:
            return so, cached.num_computed_tokens[cached.req_ids.index(rid)]
    raise AssertionError(f"{rid} never scheduled")


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

    def _start(self, config, kv_cache_config, num_blocks, tp):
        self.config = config
        self.kv_cache_config = kv_cache_config
        assert kv_cache_config.num_blocks == num_blocks
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BS,
            log_stats=True,
        )
        assert type(self.scheduler.connector).__name__ == "UmbpConnector"
        self.sched_side = self.scheduler.connector.scheduler_side
        self.index = self.sched_side.index
        # One worker per tensor-parallel rank, each with its KV cache exactly as vLLM's model
        # runner allocates it for this layout (its shard of the heads).
        self.tp = tp
        self.ranks = []
        for rank in range(tp):
            kv = allocate_kv_cache(
                kv_cache_config,
                torch.device("cpu"),
                config.cache_config.get_resolved_kv_cache_layout(),
            )
            with mock.patch("umbp.vllm.connector._tp", return_value=(rank, tp)):
                worker = UmbpConnector(config, KVConnectorRole.WORKER, kv_cache_config)
            worker.register_kv_caches(kv)
            kv8 = {name: t.view(torch.uint8) for name, t in kv.items()}
            self.ranks.append(Rank(rank, worker, kv, kv8))
        self.worker, self.kv, self.kv8 = self.ranks[0].worker, self.ranks[0].kv, self.ranks[0].kv8
        self.token_bytes = self.kv8[self.layers[0]][0, :, 0, :].numel()
        self.aggregator = KVOutputAggregator(tp)
        self.requests = {}
        self.steps = 0
        self.load_errors = set()
        self.stats = {}
        self.step_stats = []
        self.prefills_checked = 0
        self.first_computed = {}
        self.computed_wrong = 0  # (request, layer) forward passes over a wrong prefix
        self._expected = {}

    # -- the model -------------------------------------------------------------------------

    def token_kv(self, tokens, pos, layer, rank=0):
        """The bytes of token ``pos``'s KV in ``layer`` on ``rank``: a function of its whole
        prefix (and of the rank, whose shard of the heads it is)."""
        h = hashlib.blake2b(
            repr((tuple(tokens[: pos + 1]), layer, rank)).encode(), digest_size=8
        ).digest()
        rng = np.random.default_rng(int.from_bytes(h, "little"))
        return rng.integers(0, 256, self.token_bytes, dtype=np.uint8)

    def forward(self, rank, layer, rid, start, end):
        """Computes tokens ``start..end-1`` of ``rid`` in layer ``layer`` (its position in
        ``self.layers``) on ``rank``."""
        raise NotImplementedError

    # -- hooks of one step -----------------------------------------------------------------

    def layer_loaded(self, r, layer, so, loads, check_loads):
        """Called on rank ``r`` when its wait for ``layer``'s load returned, before the
        forward pass reads it."""

    def check_loads(self, so, output, loads, check_loads):
        """Called once the ranks' outputs are aggregated: checks the loads that settled."""

    def check_prefill(self, rid, req):
        """Called when ``rid``'s prefill completed with no block of it failed."""

    # -- requests --------------------------------------------------------------------------

    def add(self, rid, tokens, max_tokens=1):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BS, sha256),
        )
        self.requests[rid] = req
        self.scheduler.add_request(req)
        return req

    # -- one engine step, in the model runner's order ----------------------------------------

    def _poison_loads(self, meta):
        """The step's loads as (request, KV cache group, block index, GPU block); their blocks
        hold poison on every rank, so only the load can make them right."""
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

    def step(self, check_loads=True):
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        # First, as vLLM's model runner: nothing writes the KV cache before it (a preempted
        # request's blocks, or blocks freed this step, about to be reused, may still be read
        # by an earlier step's save).
        for r in self.ranks:
            r.worker.handle_preemptions(meta)
        loads = self._poison_loads(meta)
        for r in self.ranks:
            r.worker.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                r.worker.start_load_kv(None)
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
                    self.forward(r.rank, layer, rid, computed, computed + so.num_scheduled_tokens[rid])
                r.worker.save_kv_layer(name, r.kv[name], None)
        req_ids = [rid for rid, _ in scheduled]
        sampled = []
        for rid, computed in scheduled:
            done = computed + so.num_scheduled_tokens[rid] >= self.requests[rid].num_tokens
            sampled.append([7] if done else [])
        outputs = []
        for r in self.ranks:
            w = r.worker
            if not so.has_sync_kv_loads:
                w.start_load_kv(None)
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            failed = {"failed_recving": results.failed_recving} if self.report_failed_recving else {}
            output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                **failed,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=None,
                    kv_connector_output=output,
                )
            )
        # What vLLM's executor hands the scheduler: the ranks' outputs aggregated.
        merged = self.aggregator.aggregate(outputs) if self.tp > 1 else outputs[0]
        output = merged.kv_connector_output
        invalid = output.invalid_block_ids
        self.load_errors |= invalid
        stats = output.kv_connector_stats
        if stats is not None:
            self.step_stats.append(stats)
            for k, v in stats.data.items():
                self.stats[k] = self.stats.get(k, 0) + v
        self.check_loads(so, output, loads, check_loads)
        for rid, computed in scheduled:
            req = self.requests[rid]
            done = computed + so.num_scheduled_tokens[rid] >= req.num_tokens
            if done and computed < req.num_prompt_tokens and not self._held(rid) & invalid:
                self.check_prefill(rid, req)
                self.prefills_checked += 1
        self.scheduler.update_from_output(so, merged)
        self.steps += 1
        return so

    def _held(self, rid):
        """Every GPU block ``rid`` holds, in every KV cache group."""
        return {b for ids in self.scheduler.kv_cache_manager.get_block_ids(rid) for b in ids}

    def idle_step(self):
        """One step; a step that computed nothing (loads and saves still moving) waits a
        millisecond, as an engine with nothing to run does not spin this hard."""
        so = self.step()
        if so.total_num_scheduled_tokens == 0:
            time.sleep(0.001)
        return so

    def run(self, hang=120.0):
        """Steps until every request finished and every block went back; ``hang`` seconds
        only tell a hang (a lost completion) from slow I/O."""
        deadline = time.monotonic() + hang
        while self.scheduler.requests or self.index.pending_ops():
            assert time.monotonic() < deadline, f"hung: {list(self.scheduler.requests)}"
            self.idle_step()

    def first_step_of(self, rid):
        return first_step_of(self, rid)

    def close(self):
        for r in self.ranks:
            r.worker.shutdown()
        if self.close_scheduler_side:
            self.scheduler.connector.shutdown()
