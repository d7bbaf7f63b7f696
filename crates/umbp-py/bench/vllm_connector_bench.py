"""UmbpConnector's worker side in a layer-wise step, against a blocking load through it.

The Kimi-K3 shape of `umbp-bench layers`, as vLLM lays it out: 61 layers, a block's page of
384 KiB per layer (64 tokens x 12 KV heads x 128 x K and V in fp16), so a block is 23 MiB,
against the Rust bench's 24 MiB objects; `--scale` blocks (default 16) restored from the DRAM
tier (or `--source ssd`) into CPU KV-cache tensors allocated by vLLM's own allocate_kv_cache,
layers in groups of 8. The step is driven as vLLM's model runner drives it: bind the
metadata, start_load_kv, then per layer wait_for_layer_load and a forward compute (a spin)
of the blocking load's time / 61, so the forward pass lasts as long as the blocking load.

- `blocking`: the same load through the same connector waited for whole (wait_for_layer_load
  of the last layer) before the forward pass.
- `layered`: the forward pass waits per layer (per group).

Reported: each mode's time the forward pass is blocked (`stall_ms`: start_load_kv, which runs
before the forward pass in layer-wise mode, plus wait_for_layer_load; `start_ms` alone), the
forward pass's wall time beyond its compute (`beyond_compute_ms`, what the Rust bench calls
its stall: waits, and a busy machine preempting the spinning thread), the step's wall time,
the layered/blocking stall ratio (target <= 0.5), and, with `--rust` (the umbp-bench binary),
the Rust `layers` bench's rows of the same source at the same scale and compute per layer: the
Python layered step time over the Rust one (target <= 1.1: the connector's Python adds
per-step cost only).
Every restored byte is verified after every run. Needs vLLM (bash .ci/vllm-venv):

    python crates/umbp-py/bench/vllm_connector_bench.py [--scale 16] [--iterations 3] \
        [--source dram|ssd] [--rust target/release/umbp-bench]

Prints a table and one JSON line.

`--scheduler` measures the other half, beside vLLM's own OffloadingConnector (its native CPU
offloading), on vLLM's real v1 Scheduler on CPU: both connectors loaded the way `vllm serve`
loads them, the same workload (each round, `--requests` new prompts of `--blocks` blocks are
prefilled and saved, vLLM's own prefix cache is reset, and the same prompts come again as new
requests, which the connector must serve), both with async loads, rounds alternating between
the connectors; each connector's CPU tier holds `--tier-rounds` rounds (2: both evict once
full; 11 with the default 9 rounds and a warm-up: nothing is evicted, so both serve every hit
and the scheduler times compare equal work). Timed: the scheduler's calls (`schedule` and
`update_from_output`, which run the connector's scheduler side), per round; reported per
connector with the hits, and the umbp/OffloadingConnector ratio of each pair of rounds (median,
quartiles, range). The worker side runs in the model runner's order between them, untimed:
umbp's real worker over CPU tensors, and OffloadingConnector's real worker (vLLM's
`OffloadingConnectorWorker`) whose transfer worker, which needs CUDA or XPU (its CPU spec
refuses anything else), is replaced by one that copies the same blocks with torch on CPU
(`CPUCopyOffloadingSpec` below, loaded through the spec plug-in vLLM offers). So the data paths
are not compared: on a GPU server OffloadingConnector moves blocks with CUDA copies, umbp with
its gather kernel.

    python crates/umbp-py/bench/vllm_connector_bench.py --scheduler [--rounds 9] \
        [--requests 16] [--blocks 64] [--tier-rounds 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from umbp.kvtiers import DRAM, SSD
from umbp.vllm import UmbpConnector, UmbpConnectorMetadata

# The engine loop's pieces the connector's tests and `python -m umbp.vllm.check` use too: the
# model directory, vLLM's config, requests, and what the model runner hands the scheduler.
from umbp.vllm._harness import (
    connector_output,
    engine_config,
    model_runner_output,
    new_request,
    umbp_transfer_config,
    write_model_dir,
)

LAYERS = 61
GROUP = 8
BLOCK_TOKENS, KV_HEADS, HEAD = 64, 12, 128


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class CPUCopyOffloadingWorker(OffloadingWorker):
    """OffloadingConnector's transfer worker for CPU KV caches: each store and load copies its
    blocks with torch at submit, between the KV cache and a CPU tier laid out as vLLM's CPU
    worker lays it out (one tensor of chunks per KV cache tensor), and reports done at the
    next poll, as vLLM's reports a finished CUDA copy."""

    def __init__(self, kv_caches, num_chunks, blocks_per_chunk):
        assert blocks_per_chunk == 1, "one GPU block per chunk, as the bench configures"
        self.gpu = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self.cpu = [torch.zeros(num_chunks, g.shape[1], dtype=torch.int8) for g in self.gpu]
        self.done = []

    def _copy(self, job_id, dst, dst_ids, src, src_ids):
        d, si = torch.from_numpy(dst_ids).long(), torch.from_numpy(src_ids).long()
        for a, b in zip(dst, src):
            a.index_copy_(0, d, b.index_select(0, si))
        self.done.append(job_id)
        return True

    def submit_store(self, job_id, src_spec, dst_spec):
        return self._copy(job_id, self.cpu, dst_spec.block_ids, self.gpu, src_spec.block_ids)

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        return self._copy(job_id, self.gpu, dst_spec.block_ids, self.cpu, src_spec.block_ids)

    def get_finished(self):
        done, self.done = self.done, []
        return [TransferResult(job_id, True) for job_id in done]

    def wait(self, job_ids):
        pass


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (its manager, eviction and sizing unchanged) with the
    transfer worker above in place of its CUDA one."""

    def get_worker(self, kv_caches):
        if self._worker is None:
            self._worker = CPUCopyOffloadingWorker(
                kv_caches, self.num_chunks, self.blocks_per_chunk
            )
        return self._worker


class SchedulerRun:
    """vLLM's Scheduler with one connector (by name, as vllm serve loads it), its worker side
    over CPU KV caches, and a forward pass that computes nothing: the connector's scheduler
    side is what the bench times."""

    BS, LAYERS, KV_HEADS, HEAD = 16, 4, 2, 64

    def __init__(self, work, connector, num_blocks, tier_bytes):
        if connector == "umbp":
            transfer = umbp_transfer_config(
                {"dram_bytes_per_rank": tier_bytes, "load_mode": "async"}
            )
        else:
            transfer = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "cpu_bytes_to_use": tier_bytes,
                    "spec_name": "CPUCopyOffloadingSpec",
                    "spec_module_path": __name__,
                },
            )
        model = write_model_dir(work, self.LAYERS, kv_heads=self.KV_HEADS, head=self.HEAD)
        self.config = engine_config(model, transfer, block_size=self.BS, max_batched=8192)
        cache = self.config.cache_config
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(self.LAYERS)]
        spec = FullAttentionSpec(
            block_size=self.BS, num_kv_heads=self.KV_HEADS, head_size=self.HEAD, dtype=torch.float16
        )
        kv_config = get_kv_cache_config_from_groups(
            self.config,
            [KVCacheGroupSpec(self.layers, spec)],
            num_blocks * self.LAYERS * spec.page_size_bytes,
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=self.BS,
            log_stats=True,
        )
        self.kv = allocate_kv_cache(
            kv_config, torch.device("cpu"), cache.get_resolved_kv_cache_layout()
        )
        self.worker = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, kv_config
        )
        self.worker.register_kv_caches(self.kv)
        self.requests = {}

    def add(self, rid, tokens):
        req = new_request(rid, tokens, block_size=self.BS)
        self.requests[rid] = req
        self.scheduler.add_request(req)

    def step(self):
        """One engine step; returns the seconds spent in the scheduler's two calls, the tokens
        it scheduled, and the prompt tokens the connector supplied (vLLM's own statistic)."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        timed = time.perf_counter() - t0
        w, meta = self.worker, so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in self.layers:
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, self.kv[name], None)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        output = connector_output(w, so.finished_req_ids)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.requests[rid]
            # schedule() already counted this step's tokens as computed: a request whose
            # prefill goes on next step (chunked) samples nothing yet.
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done else [])
        model_output = model_runner_output(req_ids, sampled, output)
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, model_output)
        timed += time.perf_counter() - t0
        hits = 0
        for out in outputs.values():
            stats = out.scheduler_stats
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                hits += stats.connector_prefix_cache_stats.hits
        return timed, so.total_num_scheduled_tokens, hits

    def run(self, prompts, tag, hang=300.0):
        """Adds the prompts as new requests and steps until every one finished. Returns the
        scheduler's seconds, the steps, and the prompt tokens the connector supplied."""
        for i, p in enumerate(prompts):
            self.add(f"{tag}-{i}", p)
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        timed = steps = external = 0
        deadline = time.monotonic() + hang
        # vLLM's engine loop: step while the scheduler has requests, finished requests whose
        # blocks wait on the connector, or connector work to push.
        while self.scheduler.has_requests():
            assert time.monotonic() < deadline, f"hung: {list(self.scheduler.requests)}"
            t, tokens, hits = self.step()
            timed += t
            steps += 1
            external += hits
            if tokens == 0:
                time.sleep(0.0005)  # loads or saves still moving: an idle engine step
        for r in ids:
            self.requests.pop(r)
        return timed, steps, external

    def round(self, prompts, tag):
        """Saves the prompts (a prefill each), forgets them in vLLM's own prefix cache, and
        asks for them again: the second pass's hits come from the connector alone."""
        save = self.run(prompts, f"{tag}-save")
        assert self.scheduler.reset_prefix_cache(), "vLLM's prefix cache did not reset"
        hit = self.run(prompts, f"{tag}-hit")
        return save, hit

    def close(self):
        self.worker.shutdown()


def scheduler_main(args):
    work = tempfile.mkdtemp(dir=args.dir)
    bs = SchedulerRun.BS
    page = bs * SchedulerRun.KV_HEADS * SchedulerRun.HEAD * 2 * 2  # K and V, fp16
    block_bytes = SchedulerRun.LAYERS * page
    # Room for `--tier-rounds` rounds in each connector's CPU tier (fewer than the rounds run:
    # both must evict, least recent first), and a KV cache that holds a round's requests.
    per_round = args.requests * args.blocks
    tier_bytes = args.tier_rounds * per_round * (-(-block_bytes // 4096) * 4096)
    num_blocks = per_round + args.requests + 64
    runs = {}
    for name in ("umbp", "offloading"):
        os.makedirs(os.path.join(work, name), exist_ok=True)
        runs[name] = SchedulerRun(os.path.join(work, name), name, num_blocks, tier_bytes)
    rng = np.random.default_rng(11)
    rows = {name: [] for name in runs}
    # Round 0 warms both up (imports, first allocations) and is not counted.
    for r in range(args.rounds + 1):
        prompts = [
            rng.integers(0, 1000, args.blocks * bs + 1).tolist() for _ in range(args.requests)
        ]
        order = ("umbp", "offloading") if r % 2 else ("offloading", "umbp")
        for name in order:
            (save_s, save_steps, _), (hit_s, hit_steps, hit_tokens) = runs[name].round(
                prompts, f"r{r}"
            )
            if r:
                rows[name].append((save_s, save_steps, hit_s, hit_steps, hit_tokens))
    for run in runs.values():
        run.close()
    load = os.getloadavg()
    want_hits = args.requests * args.blocks * bs
    table = []
    for name, rs in rows.items():
        table.append(
            {
                "connector": name,
                "save_sched_ms": statistics.median(x[0] for x in rs) * 1e3,
                "save_steps": statistics.median(x[1] for x in rs),
                "hit_sched_ms": statistics.median(x[2] for x in rs) * 1e3,
                "hit_steps": statistics.median(x[3] for x in rs),
                "hit_tokens": statistics.median(x[4] for x in rs),
                "round_sched_ms": statistics.median(x[0] + x[2] for x in rs) * 1e3,
            }
        )
    ratios = sorted(
        (u[0] + u[2]) / (o[0] + o[2]) for u, o in zip(rows["umbp"], rows["offloading"])
    )
    result = {
        "bench": "vllm_connector_scheduler",
        "requests": args.requests,
        "blocks_per_request": args.blocks,
        "block_tokens": bs,
        "rounds": args.rounds,
        "tier_rounds": args.tier_rounds,
        "rows": table,
        "hit_tokens_possible": want_hits,
        "umbp_over_offloading": {
            "median": statistics.median(ratios),
            "quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else ratios * 2,
            "min": ratios[0],
            "max": ratios[-1],
            "pairs": len(ratios),
        },
        "load_average": load,
    }
    print(
        f"{'connector':11} {'save ms':>9} {'steps':>6} {'hit ms':>9} {'steps':>6} "
        f"{'hit tokens':>11} {'round ms':>9}"
    )
    for t in table:
        print(
            f"{t['connector']:11} {t['save_sched_ms']:9.1f} {t['save_steps']:6.0f} "
            f"{t['hit_sched_ms']:9.1f} {t['hit_steps']:6.0f} "
            f"{t['hit_tokens']:>5.0f}/{want_hits:<5} {t['round_sched_ms']:9.1f}"
        )
    q = result["umbp_over_offloading"]
    print(
        f"scheduler time per round, umbp / OffloadingConnector: median {q['median']:.2f}, "
        f"quartiles [{q['quartiles'][0]:.2f}, {q['quartiles'][1]:.2f}], range "
        f"[{q['min']:.2f}, {q['max']:.2f}] over {q['pairs']} pairs of rounds; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(json.dumps(result))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=16, help="blocks restored per step")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--source", choices=["dram", "ssd"], default="dram")
    ap.add_argument("--rust", help="the umbp-bench binary, to compare with its layers bench")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the SSD tier's file goes")
    ap.add_argument(
        "--scheduler",
        action="store_true",
        help="the scheduler side on vLLM's Scheduler, beside vLLM's OffloadingConnector",
    )
    ap.add_argument("--rounds", type=int, default=9, help="--scheduler: rounds per connector")
    ap.add_argument("--requests", type=int, default=16, help="--scheduler: prompts per round")
    ap.add_argument("--blocks", type=int, default=64, help="--scheduler: blocks per prompt")
    ap.add_argument(
        "--tier-rounds",
        type=int,
        default=2,
        help="--scheduler: rounds each connector's CPU tier holds (more than --rounds + 1: "
        "nothing is evicted)",
    )
    args = ap.parse_args()
    if args.scheduler:
        scheduler_main(args)
        return

    work = tempfile.mkdtemp(dir=args.dir)
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16
    )
    page = spec.page_size_bytes
    block_bytes = LAYERS * page
    slot = -(-block_bytes // 4096) * 4096
    tier_bytes = args.scale * slot
    extra = {
        "dram_bytes_per_rank": tier_bytes if args.source == "dram" else 0,
        "layers_per_group": GROUP,
        "load_mode": "layerwise",
    }
    if args.source == "ssd":
        extra.update(ssd_path=os.path.join(work, "kv.ssd"), ssd_bytes_per_rank=tier_bytes)
    model = write_model_dir(work, LAYERS, kv_heads=KV_HEADS, head=HEAD)
    config = engine_config(model, umbp_transfer_config(extra), block_size=BLOCK_TOKENS)
    cache = config.cache_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    num_blocks = args.scale + 1
    kv_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(layers, spec)], num_blocks * LAYERS * page
    )
    kv = allocate_kv_cache(kv_config, torch.device("cpu"), cache.get_resolved_kv_cache_layout())
    conn = UmbpConnector(config, KVConnectorRole.WORKER, kv_config)
    conn.register_kv_caches(kv)
    w = conn.worker_side

    # The tier holds `scale` blocks of known bytes; block i loads into GPU block i + 1.
    rng = np.random.default_rng(7)
    stored = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(args.scale)]
    tier = w.dram if args.source == "dram" else w.ssd
    for i, data in enumerate(stored):
        for at in range(0, block_bytes, 1 << 20):  # the SSD engine writes 1 MiB at most
            w.engine.write(tier, i * slot + at, data[at : at + (1 << 20)].tobytes())
    kv8 = [kv[name].view(torch.uint8) for name in layers]
    tier_name = DRAM if args.source == "dram" else SSD
    ops = iter(range(1, 1 << 30))

    def meta():
        items = [(next(ops), tier_name, i, i + 1) for i in range(args.scale)]
        return UmbpConnectorMetadata(loads={"bench": items}, layerwise=True)

    def poison():
        for t in kv8:
            t[1 : args.scale + 1] = 0xA5

    # The KV cache's backing allocation as bytes: a layer's page of block b starts at the
    # layer's offset plus b block strides (vLLM's placement), whatever the view's axis order.
    storage = kv[layers[0]].untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    stride = {n: t.block_stride for t in kv_config.kv_cache_tensors for n in t.layers}
    offsets = [kv[n].data_ptr() - storage.data_ptr() for n in layers]

    def verify():
        for i, data in enumerate(stored):
            for layer, name in enumerate(layers):
                at = offsets[layer] + (i + 1) * stride[name]
                if not np.array_equal(
                    flat[at : at + page], data[layer * page : (layer + 1) * page]
                ):
                    return False
        return True

    def step(mode, compute_s):
        poison()
        m = meta()
        start = time.perf_counter()
        conn.bind_connector_metadata(m)
        conn.start_load_kv(None)  # before the forward pass: it blocks the forward too
        stall = started = time.perf_counter() - start
        if mode == "blocking":
            t0 = time.perf_counter()
            conn.wait_for_layer_load(layers[-1])  # every group
            stall += time.perf_counter() - t0
        for name in layers:
            t0 = time.perf_counter()
            conn.wait_for_layer_load(name)
            stall += time.perf_counter() - t0
            spin(compute_s)
        forward = time.perf_counter() - start
        conn.wait_for_save()
        conn.get_finished(set())
        errors = conn.get_block_ids_with_load_errors()
        conn.build_connector_worker_meta()
        conn.get_kv_connector_stats()
        conn.clear_connector_metadata()
        wall = time.perf_counter() - start
        return stall, wall, not errors and verify(), started, forward - LAYERS * compute_s

    # The blocking load's time sets the forward pass's compute (warm-up run first).
    step("blocking", 0.0)
    load_s = statistics.median(step("blocking", 0.0)[0] for _ in range(3))
    compute_s = load_s / LAYERS
    runs = {"blocking": [], "layered": []}
    for _ in range(args.iterations):
        for mode in ("blocking", "layered"):
            runs[mode].append(step(mode, compute_s))
    rows = []
    for mode, rs in runs.items():
        rows.append(
            {
                "source": args.source,
                "mode": mode,
                "stall_ms": statistics.median(r[0] for r in rs) * 1e3,
                "step_ms": statistics.median(r[1] for r in rs) * 1e3,
                "start_ms": statistics.median(r[3] for r in rs) * 1e3,
                "beyond_compute_ms": statistics.median(r[4] for r in rs) * 1e3,
                "compute_us": compute_s * 1e6,
                "verified": all(r[2] for r in rs),
            }
        )
    blocking, layered = rows
    result = {
        "bench": "vllm_connector",
        "scale": args.scale,
        "block_mib": block_bytes / (1 << 20),
        "rows": rows,
        "stall_ratio": layered["stall_ms"] / blocking["stall_ms"],
        "stall_target": 0.5,
    }
    if args.rust:
        # The Rust bench with the same compute per layer, so both forward passes are alike.
        out = subprocess.run(
            [args.rust, "--json", "layers", "--scale", str(args.scale)]
            + ["--compute-us", f"{compute_s * 1e6:.1f}", "--iterations", str(args.iterations)],
            capture_output=True,
            text=True,
            check=False,
        )
        rust = {
            r["mode"]: r
            for r in (json.loads(x) for x in out.stdout.splitlines() if x.startswith("{"))
            if r.get("source") == args.source
        }
        if "layered" in rust:
            r = rust["layered"]
            rust_step = r["compute_us"] * LAYERS / 1e3 + r["stall_ms"]
            result["rust_layered"] = r
            result["rust_step_ms"] = rust_step
            # A Rust step is its forward pass's wall time (compute plus stall), a Python one
            # that plus the step's bookkeeping after it. Its objects are 24 MiB, these blocks
            # 22.9 MiB: the times compare as they are.
            result["python_over_rust_step"] = layered["step_ms"] / rust_step
            result["python_over_rust_target"] = 1.1
        else:
            result["rust_error"] = (out.stderr or out.stdout)[-500:]
    print(
        f"{'source':6} {'mode':9} {'stall ms':>9} {'start ms':>9} {'step ms':>9} "
        f"{'compute us':>11} verified"
    )
    for r in rows:
        print(
            f"{r['source']:6} {r['mode']:9} {r['stall_ms']:9.1f} {r['start_ms']:9.1f} "
            f"{r['step_ms']:9.1f} {r['compute_us']:11.0f} {'yes' if r['verified'] else 'NO'}"
        )
    print(json.dumps(result))
    conn.shutdown()


if __name__ == "__main__":
    main()
