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

The package, a module per part: ``config`` (:class:`UmbpConfig`, the extra-config keys),
``layout`` (what a block is on a rank, KV cache groups), ``metadata`` (what the scheduler
side and the workers send each other; vLLM pickles it), ``stats`` (counters and Prometheus
metrics), ``scheduler`` (the index and the per-request bookkeeping), ``worker`` (each rank's
tiers and transfers) and ``connector`` (:class:`UmbpConnector`, the class vLLM loads). vLLM
loads the connector from this package (``"kv_connector_module_path": "umbp.vllm"``), which
re-exports the names below.
"""

from __future__ import annotations

from .config import UmbpConfig, _dp_rank
from .connector import UmbpConnector
from .layout import SLOT_ALIGN, _Layout
from .metadata import Item, UmbpConnectorMetadata, UmbpWorkerMetadata
from .stats import UmbpConnectorStats, UmbpPromMetrics
from .worker import TIER_PAGE

__all__ = [
    "UmbpConnector",
    "UmbpConfig",
    "UmbpConnectorMetadata",
    "UmbpWorkerMetadata",
    "UmbpConnectorStats",
    "UmbpPromMetrics",
]
