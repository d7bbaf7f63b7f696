"""umbp.vllm.UmbpConnector with several KV cache groups (vLLM's hybrid allocator,
``SupportsHMA``), against vLLM's own v1 Scheduler on CPU.

The model has 4 layers: 0 and 2 full attention (KV cache group 0), 1 and 3 sliding window
(group 1, a window of ``WINDOW`` tokens), the KV cache config built from those groups by
vLLM's own planner, so vLLM's hybrid coordinator frees a running request's sliding-window
blocks below its window (its block table then holds vLLM's null block there). The worker
side runs in the model runner's order over CPU tensors vLLM's ``allocate_kv_cache`` lays out
(one layer of each group shares one tensor). The "forward pass" writes, for every computed
token, bytes derived from the token's whole prefix into each layer; layer L is computed wrong
where layer L-1's KV of the prefix it sees (its group's blocks still present) is wrong, so a
block computed over a failed load holds wrong bytes. The engine loop is vllm_harness.py's,
shared with test_vllm.py; ``Hybrid`` adds the groups' model and checks.

Needs vLLM (`bash .ci/vllm-venv`); skipped with the reason printed where it is absent, and a
failure where UMBP_REQUIRE_VLLM=1.
"""

import gc
import os
import time
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest

# First: it skips this module (or fails, with UMBP_REQUIRE_VLLM=1) where vLLM is absent.
from vllm_harness import BS, HEAD, KV_HEADS, EngineHarness, prompt, vllm_config

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from umbp.kvtiers import DRAM, READY, SAVING, SSD
from umbp.vllm import UmbpConnector

WINDOW = 2 * BS  # the sliding window: a hit's end needs its last 2 blocks in group 1
FULL = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SWA = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
LAYERS = [FULL[0], SWA[0], FULL[1], SWA[1]]  # the forward pass's order


def _spec(window=None):
    kw = dict(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16)
    return FullAttentionSpec(**kw) if window is None else SlidingWindowSpec(**kw, sliding_window=window)


def slot_bytes():
    return -(-2 * _spec().page_size_bytes // 4096) * 4096


class FailingLoads:
    """Makes the worker's loads of the given (KV cache group, GPU block id) fail (an object
    past the end of its tier: the engine rejects it alone)."""

    def __init__(self, worker_side, targets):
        self._side = worker_side
        self._objects = worker_side._objects
        self.targets = set(targets)
        self.failed = 0
        worker_side._objects = self

    def __call__(self, items, meta):
        objects = self._objects(items, meta)
        loads = {it[0] for its in meta.loads.values() for it in its}
        out = []
        for (op, _, _, block), o in zip(items, objects):
            if op in loads and (meta.groups.get(op, 0), block) in self.targets:
                o = replace(o, page_offsets=np.asarray(o.page_offsets) + (1 << 50))
                self.failed += 1
            out.append(o)
        return out


class Hybrid(EngineHarness):
    """vLLM's scheduler over a full-attention and a sliding-window KV cache group, with
    UmbpConnector, one worker per rank over CPU tensors, and a fake forward pass."""

    # A load that failed is reported as vLLM's model runner reports it: the request's
    # failed receive.
    report_failed_recving = True
    close_scheduler_side = True

    def __init__(
        self,
        tmp_path,
        *,
        num_blocks=96,
        max_batched=4096,
        kv_events=False,
        sw_first=False,
        tp=1,
        **extra,
    ):
        extra.setdefault("dram_bytes_per_rank", 16 << 20)
        # vLLM turns its hybrid allocator off on platforms without a GPU; these tests run
        # its scheduler as a GPU platform would.
        with mock.patch.object(current_platform, "support_hybrid_kv_cache", return_value=True):
            config = vllm_config(
                tmp_path,
                layers=len(LAYERS),
                extra=extra,
                max_batched=max_batched,
                tp=tp,
                kv_events=kv_events,
            )
        # vLLM keeps its hybrid allocator on only for a connector that supports it.
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
        self.layers = LAYERS
        # vLLM orders the groups as the model's layer types come; either may be first.
        self.groups = [SWA, FULL] if sw_first else [FULL, SWA]
        self.group_of = {n: g for g, layers in enumerate(self.groups) for n in layers}
        self.sw = self.groups.index(SWA)
        groups = [KVCacheGroupSpec(ls, _spec(WINDOW if ls is SWA else None)) for ls in self.groups]
        kv_cache_config = get_kv_cache_config_from_groups(
            config, groups, available_memory=num_blocks * 2 * _spec().page_size_bytes
        )
        self._start(config, kv_cache_config, num_blocks, tp)
        assert isinstance(self.scheduler.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
        self.null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        self.failed_recving = set()
        self.loads = []  # (request, group, block index, GPU block) of every load, in order

    # -- the model -------------------------------------------------------------------------

    def expected_rows(self, tokens, layer, n, rank=0):
        key = (tuple(tokens[:n]), layer, rank)
        rows = self._expected.get(key)
        if rows is None:
            rows = np.stack([self.token_kv(tokens, p, layer, rank) for p in range(n)])
            self._expected[key] = rows
        return rows

    def block_ids(self, rid):
        return self.scheduler.kv_cache_manager.get_block_ids(rid)

    def rows(self, layer, block_ids, positions, rank=0):
        blocks = np.asarray(block_ids)[positions // BS]
        out = self.ranks[rank].kv8[layer].numpy()[blocks, :, positions % BS, :]
        return out.reshape(len(positions), -1)

    def seen_is_right(self, rid, layer, start, rank=0):
        """Whether the KV of ``layer`` that tokens from ``start`` on attend to (its group's
        blocks of the prefix still present) holds what the prefix implies."""
        ids = self.block_ids(rid)[self.group_of[layer]]
        pos = np.array([p for p in range(start) if ids[p // BS] != self.null], dtype=np.int64)
        if len(pos) == 0:
            return True
        want = self.expected_rows(self.requests[rid].all_token_ids, layer, start, rank)[pos]
        return np.array_equal(self.rows(layer, ids, pos, rank), want)

    def forward(self, rank, li, rid, start, end):
        layer = LAYERS[li]
        tokens = self.requests[rid].all_token_ids
        rows = self.expected_rows(tokens, layer, end, rank)[start:end]
        if li > 0 and not self.seen_is_right(rid, LAYERS[li - 1], start, rank):
            rows = rows ^ 0x5A  # attention over wrong KV: wrong KV in turn
            self.computed_wrong += 1
        ids = self.block_ids(rid)[self.group_of[layer]]
        pos = np.arange(start, end)
        blocks = np.asarray(ids)[pos // BS]
        assert self.null not in blocks, "the forward pass writes into a block vLLM freed"
        cache = self.ranks[rank].kv8[layer].numpy()
        cache[blocks, :, pos % BS, :] = rows.reshape(end - start, *cache.shape[1:2], -1)

    def block_is_right(self, rid, group, index, block_id):
        tokens = self.requests[rid].all_token_ids
        pos = np.arange(index * BS, (index + 1) * BS)
        for rank in range(self.tp):
            for layer in self.groups[group]:
                want = self.expected_rows(tokens, layer, (index + 1) * BS, rank)[pos]
                got = self.rows(layer, [block_id] * (index + 1), pos, rank)
                if not np.array_equal(got, want):
                    return False
        return True

    def page(self, tokens, layer, index, rank=0):
        """Block ``index``'s page of ``layer`` as the KV cache holds it when right."""
        view = self.kv8[layer][0]
        rows = self.expected_rows(tokens, layer, (index + 1) * BS, rank)[index * BS :]
        page = rows.reshape(BS, view.shape[0], -1).transpose(1, 0, 2)  # the view's axes
        # In memory order (the layout's): axes by falling stride.
        order = sorted(range(view.dim()), key=lambda d: -view.stride(d))
        return np.ascontiguousarray(page.transpose(order)).reshape(-1)

    def stored_object(self, entry, rank=0):
        """The bytes an index entry's slot holds on ``rank`` (DRAM arena or SSD file)."""
        side = self.ranks[rank].worker.worker_side
        size, slot = 2 * _spec().page_size_bytes, side.layout.slot_bytes
        if entry.tier == DRAM:
            return side._arena[entry.slot * slot : entry.slot * slot + size]
        with open(side.ssd_path, "rb") as f:
            f.seek(entry.slot * slot)
            return np.frombuffer(f.read(size), dtype=np.uint8)

    # -- the checks of one step (EngineHarness.step calls them) ------------------------------

    def check_loads(self, so, output, loads, check_loads):
        self.loads.extend(loads)
        failed = output.failed_recving or set()
        self.failed_recving |= failed
        # A load that settled is right, byte for byte, unless reported failed.
        settled = (output.finished_recving or set()) | (
            {x[0] for x in loads} if so.has_sync_kv_loads else set()
        )
        for rid, group, index, block in [x for x in self.loads if x[0] in settled]:
            if rid not in failed and block not in self.load_errors:
                assert self.block_is_right(rid, group, index, block), (rid, group, index)
        self.loads = [x for x in self.loads if x[0] not in settled]

    def check_prefill(self, rid, req):
        # The prefill is complete: every block vLLM still holds, in each group, holds what
        # the prompt implies.
        for group, ids in enumerate(self.block_ids(rid)):
            for index in range(req.num_prompt_tokens // BS):
                if ids[index] != self.null:
                    assert self.block_is_right(rid, group, index, ids[index]), (
                        rid,
                        group,
                        index,
                    )


def published_blocks_are_right(h, tokens):
    """Every block of ``tokens``' prefix the index holds as a hit, in each group, holds in its
    tier exactly what the prefix implies; returns how many were checked."""
    probe = h.add(f"probe{len(h.requests)}", tokens)
    h.scheduler.finish_requests(probe.request_id, _finished_aborted())
    checked = 0
    for group, layers in enumerate(h.groups):
        for i in range(len(tokens) // BS):
            key = probe.block_hashes[i] if group == 0 else (group, probe.block_hashes[i])
            e = h.index.entry(key)
            if e is None or e.state != READY:
                continue
            for rank in range(h.tp):
                want = np.concatenate([h.page(tokens, layer, i, rank) for layer in layers])
                assert np.array_equal(h.stored_object(e, rank), want), (group, i, e, rank)
            checked += 1
    return checked


def _finished_aborted():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def test_the_connector_tells_vllm_it_supports_the_hybrid_allocator_and_refuses_mamba_groups():
    assert supports_hma(UmbpConnector)
    # A Mamba group's blocks hold a recurrent state, not the KV of a prefix's tokens: refused
    # at start, with the reason, rather than cached wrong.
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

    from umbp.vllm import _Layout

    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float16,))
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(FULL, _spec()), KVCacheGroupSpec(SWA, mamba)],
    )
    with pytest.raises(NotImplementedError, match="group 1 is a MambaSpec"):
        _Layout.of(config)


def test_a_hybrid_prefix_saved_by_one_request_loads_every_groups_blocks_byte_for_byte(tmp_path):
    h = Hybrid(tmp_path, layers_per_group=1)
    try:
        shared = prompt(1, 10 * BS)
        a = h.add("a", shared + prompt(2, 5))
        h.run()
        # Every block of both groups was saved: the sliding-window group still held them all
        # in the step that computed them.
        for i in range(10):
            assert h.index.is_hit(a.block_hashes[i]) and h.index.is_hit((1, a.block_hashes[i]))
        assert h.stats.get("saved_blocks.dram") == 20
        assert h.scheduler.reset_prefix_cache()
        b = h.add("b", shared + prompt(3, 21))
        so, computed = h.first_step_of("b")
        assert computed == 10 * BS
        assert so.num_scheduled_tokens["b"] == len(b.prompt_token_ids) - 10 * BS
        h.run()
        # Group 0: all 10 blocks; group 1: only the window's blocks at the hit's end (8, 9),
        # the rest are vLLM's null block.
        assert h.stats.get("loaded_blocks.dram") == 12, h.stats
        assert h.stats.get("loaded_bytes.dram") == 12 * 2 * _spec().page_size_bytes
        assert not h.load_errors and h.prefills_checked == 2
        assert published_blocks_are_right(h, shared + prompt(3, 21)) == 2 * 11
    finally:
        h.close()


def test_a_hybrid_prefix_saved_by_one_instance_loads_in_another(tmp_path):
    # Instance A saves to its SSD tier with an embedded pool and stops; instance B, started
    # on the same files, hits and loads every group's blocks byte for byte.
    extra = dict(
        pool="embedded",
        dram_bytes_per_rank=0,
        ssd_path=str(tmp_path / "kv.ssd"),
        ssd_bytes_per_rank=64 * slot_bytes(),
    )
    shared = prompt(5, 6 * BS)
    a = Hybrid(tmp_path, **extra)
    try:
        a.add("a", shared + [9])
        a.run()
        assert a.stats.get("saved_blocks.ssd") == 12
    finally:
        a.close()
    del a  # the embedded index's file opens in one process at a time: A's must close
    gc.collect()
    b = Hybrid(tmp_path, **extra)
    try:
        b.add("b", shared + prompt(6, 20))
        so, computed = b.first_step_of("b")
        assert computed == 6 * BS
        b.run()
        assert b.stats.get("loaded_blocks.ssd") == 6 + 2, b.stats
        assert not b.load_errors and b.prefills_checked == 1
    finally:
        b.close()


@pytest.mark.parametrize("missing,hit", [(9, 9), (8, 8), (3, 10), (0, 10)])
def test_a_block_missing_in_the_sliding_window_group_cuts_the_hit_only_inside_the_window(
    tmp_path, missing, hit
):
    # A hit of n blocks needs blocks n-2 and n-1 of the sliding-window group (its window at
    # the hit's end): a missing block there cuts the hit before it; one further back is not
    # needed (vLLM keeps no block for it).
    h = Hybrid(tmp_path)
    try:
        shared = prompt(11, 10 * BS)
        a = h.add("a", shared + [9])
        h.run()
        h.index._drop(h.index.entry((1, a.block_hashes[missing])))
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(12, 7))
        so, computed = h.first_step_of("b")
        assert computed == hit * BS
        h.run()
        assert not h.load_errors and h.prefills_checked == 2
    finally:
        h.close()


def test_a_block_missing_in_the_full_attention_group_cuts_the_hit(tmp_path):
    h = Hybrid(tmp_path)
    try:
        shared = prompt(13, 10 * BS)
        a = h.add("a", shared + [9])
        h.run()
        h.index._drop(h.index.entry(a.block_hashes[4]))
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(14, 7))
        so, computed = h.first_step_of("b")
        assert computed == 4 * BS
        h.run()
        assert not h.load_errors and h.prefills_checked == 2
    finally:
        h.close()


def test_layerwise_loads_are_refused_with_several_groups(tmp_path):
    # vLLM 0.33 takes a failed load back per request with several groups, and only from a
    # request that still waits for it: a load feeding the step that computes the rest could
    # not fail safely.
    with pytest.raises(NotImplementedError, match="load_mode must be"):
        Hybrid(tmp_path, load_mode="layerwise")


@pytest.mark.parametrize("group,index,retry", [(1, 8, 8), (1, 9, 9), (0, 5, 5), (1, 3, 10)])
def test_a_failed_load_in_one_group_fails_the_request_and_only_what_is_left_loads_again(
    tmp_path, group, index, retry
):
    # B's hit of A's 10 blocks loads group 0's 10 and group 1's last 2 (8, 9); the load of
    # one group's block fails (group 1's block 3 is not loaded at all: nothing fails). The
    # request fails as a whole (failed_recving: vLLM 0.33 has no block ids across groups),
    # before anything was computed over it; the failed block left the index, so vLLM's retry
    # hits what every group can still restore and recomputes the rest, which is saved anew.
    # Every block the index then holds is right, and a repeat of B hits all of it.
    h = Hybrid(
        tmp_path,
        dram_bytes_per_rank=0,
        ssd_path=str(tmp_path / "kv.ssd"),
        ssd_bytes_per_rank=128 * slot_bytes(),
    )
    try:
        shared = prompt(21, 10 * BS)
        a = h.add("a", shared + [9])
        h.run()
        assert h.scheduler.reset_prefix_cache()
        fault = FailingLoads(h.worker.worker_side, [])
        orig = h.sched_side.after_alloc

        def after_alloc(request, blocks, n):
            orig(request, blocks, n)
            ids = blocks.get_block_ids()[group]
            if request.request_id == "b" and n and not fault.failed and index < len(ids):
                if ids[index] != h.null:
                    fault.targets = {(group, ids[index])}

        h.sched_side.after_alloc = after_alloc
        b_tokens = shared + prompt(22, 6 * BS)
        h.add("b", b_tokens + [9])
        so, computed = h.first_step_of("b")
        failed = 1 if fault.targets else 0
        assert fault.failed == failed and h.failed_recving == ({"b"} if failed else set())
        assert not h.load_errors  # never as block ids: vLLM refuses them with several groups
        key = a.block_hashes[index] if group == 0 else (group, a.block_hashes[index])
        if failed:
            # The failed copy left the index; the retry's recomputation is saving it anew.
            assert h.index.counters.failed_loads == 1 and h.index.entry(key).state == SAVING
        assert computed == retry * BS
        h.run()
        assert h.computed_wrong == 0  # nothing was computed over the failed load
        assert h.prefills_checked == 2
        assert published_blocks_are_right(h, b_tokens) == 2 * 16
        fault.targets = set()
        assert h.scheduler.reset_prefix_cache()
        h.add("c", b_tokens + prompt(23, 5))
        so, computed = h.first_step_of("c")
        assert computed == 16 * BS
        h.run()
        assert not h.load_errors and h.failed_recving == ({"b"} if failed else set())
    finally:
        h.close()


def test_dram_pressure_demotes_every_groups_blocks_to_ssd_and_they_load_byte_exact(tmp_path):
    # 12 DRAM slots for 2 x 10 blocks: demotion moves the least recent blocks of both groups
    # down to SSD (each demotion a group's object), and a repeat loads from both tiers.
    h = Hybrid(
        tmp_path,
        dram_bytes_per_rank=12 * slot_bytes(),
        dram_free_fraction=0.5,
        ssd_path=str(tmp_path / "kv.ssd"),
        ssd_bytes_per_rank=64 * slot_bytes(),
    )
    try:
        shared = prompt(31, 10 * BS)
        a = h.add("a", shared + [9])
        h.run()
        h.add("x", prompt(32, 3 * BS) + [9])  # a step more, so demotions run and settle
        h.run()
        tiers = {h.index.entry((1, k)).tier for k in a.block_hashes[8:10]}
        tiers |= {h.index.entry(k).tier for k in a.block_hashes[:10]}
        assert h.index.counters.demotions > 0 and SSD in tiers
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(33, 9))
        so, computed = h.first_step_of("b")
        assert computed == 10 * BS
        h.run()
        assert h.stats.get("loaded_blocks.ssd", 0) + h.stats.get("loaded_blocks.dram", 0) == 12
        assert h.stats.get("loaded_blocks.ssd", 0) > 0
        assert not h.failed_recving and h.prefills_checked == 3
        assert published_blocks_are_right(h, shared) == 2 * 10
    finally:
        h.close()


def test_kv_events_name_each_blocks_kv_cache_group(tmp_path):
    # A router replaying vLLM's events must tell a sliding-window group's block from the
    # full-attention one of the same hash: BlockStored and BlockRemoved carry the group.
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h = Hybrid(tmp_path, kv_events=True)
    events = []
    h.scheduler.kv_event_publisher.publish = lambda batch: events.extend(batch.events)
    try:
        tokens = prompt(41, 4 * BS)
        a = h.add("a", tokens + [9])
        h.run()
        stored = {
            (e.group_idx, e.block_hashes[0]): e
            for e in events
            if isinstance(e, BlockStored) and e.medium == "CPU"
        }
        for i in range(4):
            for group in (0, 1):
                e = stored[(group, maybe_convert_block_hash(a.block_hashes[i]))]
                assert e.token_ids == tokens[i * BS : (i + 1) * BS]
        assert len(stored) == 8
        h.index._drop(h.index.entry((1, a.block_hashes[2])))
        removed = [e for e in h.scheduler.connector.take_events() if isinstance(e, BlockRemoved)]
        assert [(e.group_idx, e.block_hashes, e.medium) for e in removed] == [
            (1, [maybe_convert_block_hash(a.block_hashes[2])], "CPU")
        ]
    finally:
        h.close()


def test_a_sliding_window_group_first_in_vllms_order_is_no_different(tmp_path):
    # vLLM orders KV cache groups as the model's layer types come (a model whose layer 0
    # slides has its sliding-window group first): the hit is still what every group can
    # restore, and every group's blocks load byte for byte.
    h = Hybrid(tmp_path, sw_first=True)
    try:
        assert h.sw == 0
        shared = prompt(51, 10 * BS)
        a = h.add("a", shared + [9])
        h.run()
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(52, 7))
        so, computed = h.first_step_of("b")
        assert computed == 10 * BS
        h.run()
        assert h.stats.get("loaded_blocks.dram") == 12 and h.prefills_checked == 2
        # A sliding-window block outside the window at the hit's end is not needed; one
        # inside it cuts the hit.
        h.index._drop(h.index.entry(a.block_hashes[3]))
        h.index._drop(h.index.entry(a.block_hashes[9]))
        assert h.scheduler.reset_prefix_cache()
        h.add("c", shared + prompt(53, 7))
        so, computed = h.first_step_of("c")
        assert computed == 9 * BS
        h.run()
        assert not h.failed_recving and h.prefills_checked == 3
    finally:
        h.close()


class RandomFailingLoads:
    """Fails each load object of the worker with probability ``p``."""

    def __init__(self, worker_side, p, seed):
        self._objects = worker_side._objects
        self._rng = np.random.default_rng(seed)
        self.p = p
        self.failed = 0
        worker_side._objects = self

    def __call__(self, items, meta):
        objects = self._objects(items, meta)
        loads = {it[0] for its in meta.loads.values() for it in its}
        out = []
        for (op, _, _, _), o in zip(items, objects):
            if op in loads and self._rng.random() < self.p:
                o = replace(o, page_offsets=np.asarray(o.page_offsets) + (1 << 50))
                self.failed += 1
            out.append(o)
        return out


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_hybrid_workload_settles_every_request_byte_exact(tmp_path, seed):
    # Bursts of requests over shared prefixes, chunked prefills (a 4.5-block token budget),
    # preemptions (64 GPU blocks), aborts, demotions to SSD and 5 % of loads failing: every
    # load the harness sees is byte-exact or its request failed and was retried, every
    # prefill holds what its prompt implies, everything settles, and every block the tiers
    # hold at the end is right.
    steps = int(os.environ.get("UMBP_KV_STEPS", "300"))
    rng = np.random.default_rng(seed)
    h = Hybrid(
        tmp_path,
        num_blocks=64,
        max_batched=72,
        dram_bytes_per_rank=24 * slot_bytes(),
        dram_free_fraction=0.25,
        ssd_path=str(tmp_path / "kv.ssd"),
        ssd_bytes_per_rank=256 * slot_bytes(),
    )
    fault = RandomFailingLoads(h.worker.worker_side, 0.05, seed)
    prefixes = [prompt(1000 * seed + i, int(rng.integers(2, 9)) * BS) for i in range(6)]
    prompts = {}
    try:
        n = 0
        for _ in range(steps):
            if len(h.scheduler.requests) < 6 and rng.random() < 0.3:
                rid = f"r{n}"
                n += 1
                tokens = prefixes[int(rng.integers(len(prefixes)))] + prompt(
                    int(rng.integers(1 << 30)), int(rng.integers(1, 3 * BS))
                )
                prompts[rid] = tokens
                h.add(rid, tokens, max_tokens=int(rng.integers(1, 4)))
            if h.scheduler.requests and rng.random() < 0.02:
                victim = str(rng.choice(sorted(h.scheduler.requests)))
                h.scheduler.finish_requests(victim, _finished_aborted())
            if rng.random() < 0.05:
                h.scheduler.reset_prefix_cache()
            so = h.step()
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.001)
        h.run()
        assert h.index.pending_ops() == 0 and not h.worker.worker_side._transfers
        assert h.prefills_checked > 10 and fault.failed > 0, (h.prefills_checked, fault.failed)
        assert h.stats.get("loaded_blocks.dram", 0) + h.stats.get("loaded_blocks.ssd", 0) > 20
        checked = sum(published_blocks_are_right(h, p) for p in prefixes)
        assert checked > 0
    finally:
        h.close()


def test_two_tp_ranks_with_several_groups_and_a_failure_on_one_rank(tmp_path):
    # Each rank keeps its shard of every group's blocks in the same slots; a load that fails
    # on rank 1 only fails the request once vLLM's aggregator merged both ranks' outputs, and
    # the retry loads what is left on both.
    h = Hybrid(tmp_path, tp=2)
    try:
        shared = prompt(61, 8 * BS)
        a = h.add("a", shared + [9])
        h.run()
        assert h.stats.get("saved_blocks.dram") == 2 * 2 * 8  # both ranks, both groups
        assert h.scheduler.reset_prefix_cache()
        fault = FailingLoads(h.ranks[1].worker.worker_side, [])
        orig = h.sched_side.after_alloc

        def after_alloc(request, blocks, n):
            orig(request, blocks, n)
            ids = blocks.get_block_ids()[h.sw]
            if request.request_id == "b" and n and not fault.failed and len(ids) == 8:
                fault.targets = {(h.sw, ids[7])}

        h.sched_side.after_alloc = after_alloc
        b = shared + prompt(62, 2 * BS)
        h.add("b", b + [9])
        so, computed = h.first_step_of("b")
        assert fault.failed == 1 and h.failed_recving == {"b"} and not h.load_errors
        assert computed == 7 * BS  # the window at 7 blocks: 5 and 6, both still there
        h.run()
        assert h.prefills_checked == 2 and h.computed_wrong == 0
        assert published_blocks_are_right(h, b) == 2 * 10
        assert h.index.counters.failed_loads == 1
        assert all(h.index.is_hit((h.sw, k)) for k in a.block_hashes[:8])
    finally:
        h.close()
