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
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache


from umbp.kvtiers import DRAM, SSD
from umbp.vllm import UmbpConnector, UmbpConnectorMetadata

LAYERS = 61
GROUP = 8
BLOCK_TOKENS, KV_HEADS, HEAD = 64, 12, 128


def model_dir(root):
    d = os.path.join(root, "model")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 1536,
                "intermediate_size": 4096,
                "num_attention_heads": KV_HEADS,
                "num_key_value_heads": KV_HEADS,
                "head_dim": HEAD,
                "num_hidden_layers": LAYERS,
                "vocab_size": 1024,
                "max_position_embeddings": 4096,
                "torch_dtype": "float16",
            },
            f,
        )
    return d


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=16, help="blocks restored per step")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--source", choices=["dram", "ssd"], default="dram")
    ap.add_argument("--rust", help="the umbp-bench binary, to compare with its layers bench")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the SSD tier's file goes")
    args = ap.parse_args()

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
    cache = CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir(work), skip_tokenizer_init=True, dtype="float16"),
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector="UmbpConnector",
            kv_connector_module_path="umbp.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
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
