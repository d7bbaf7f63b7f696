"""``python -m umbp.sglang.check CONFIG`` runs an extra config (the file given to
``--hicache-storage-backend-extra-config @CONFIG``: JSON, YAML or TOML) through SGLang's own
code on CPU before a server is started with it: SGLang's config parser, its
``HiCacheController.attach_storage_backend`` (its storage-config builder, its storage factory
loading ``module_path``/``class_name``, its storage threads), a toy MHA host pool of SGLang's
own class, and its controller's backup, hit query and prefetch over pages named by SGLang's
page hash. It prints how many pages were saved, hit and loaded, how many bytes were verified
against what was saved, and where the blocks went (DRAM / SSD / memory node, or already in the
pool); exits 0 when every page came back byte-exact, 1 when one did not, and 2 with the error
when the config is refused.

The toy pages are fresh at each run (their tokens are random), so a shared pool's older
pages are never counted; with ``--tokens-seed`` a run repeats the last one's tokens (a second
run over an embedded pool then hits the first one's pages: ``--load-only`` skips the save).

Needs SGLang (0.5.23) and torch; no GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["main", "CpuController", "toy_host_pool"]


def toy_host_pool(layout: str, *, layers: int = 2, heads: int = 2, head_dim: int = 64,
                  page: int = 16, tokens: int = 512) -> Any:
    """SGLang's own MHA host pool on CPU (unpinned), bf16, ``tokens`` device tokens."""
    from sglang.srt.mem_cache.device_pool_info import (  # type: ignore[import-untyped]
        KVBufferLayout,
        KVBuffers,
        MHABufferInfo,
    )
    from sglang.srt.mem_cache.pool_host.mha import (  # type: ignore[import-untyped]
        MHATokenToKVPoolHost,
    )

    def bufs() -> tuple:  # type: ignore[type-arg]
        return tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))

    k, v = bufs(), bufs()

    def ptrs(ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=page,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
    )


def _controller_class() -> Any:
    from sglang.srt.managers.cache_controller import (  # type: ignore[import-untyped]
        HiCacheController,
    )

    class _Cpu(HiCacheController):  # type: ignore[misc]
        """SGLang's HiCacheController with only the state its storage side reads (its
        constructor needs a GPU): ``attach_storage_backend``, ``_page_backup``,
        ``_storage_hit_query`` and ``_page_transfer`` are SGLang's own."""

        def __init__(self, host_pool: Any):  # no super().__init__: it needs a GPU
            self.mem_pool_host = self.storage_host_pool = host_pool
            self.mem_pool_device = None
            self.page_size = int(host_pool.page_size)
            self.enable_storage_metrics = False
            self.host_memory_mode = "cache"
            self.tp_group = self.attn_cp_group = self.attn_tp_group = self.pp_group = None
            self.enable_storage = False
            self.storage_backend = None
            self.storage_stop_event = threading.Event()
            self.page_get_func = self._generic_page_get
            self.page_set_func = self._generic_page_set
            self.prefetch_hits_sync_groups: List[Any] = []
            self.prefetch_completion_sync_groups: List[Any] = []

    return _Cpu


def CpuController(host_pool: Any) -> Any:  # noqa: N802 - builds an instance of a class
    """SGLang's ``HiCacheController`` over ``host_pool`` on CPU: only the state its storage
    side reads is set (its constructor needs a GPU); attach a backend with
    :func:`attach`."""
    return _controller_class()(host_pool)


def attach(controller: Any, extra: Dict[str, Any], model_name: str = "umbp-check") -> None:
    """SGLang's own ``attach_storage_backend("dynamic", ...)`` with the extra config ``extra``
    as a single-rank server passes it (tensor, pipeline and decode-context parallel size 1)."""
    from sglang.srt.runtime_context import get_parallel  # type: ignore[import-untyped]

    with get_parallel().override(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    ):
        controller.attach_storage_backend(
            storage_backend="dynamic",
            prefetch_threshold=controller.page_size,
            model_name=model_name,
            storage_backend_extra_config=extra,
        )


def _where(backend: Any) -> str:
    pooled = getattr(backend, "pooled", None)
    if pooled is not None:
        s = pooled.stored
        return (
            f"blocks: dram={s['dram']} ssd={s['ssd']} memory_node={s['memory_node']} "
            f"present={s['present']} (pool {pooled.keys.pool}, node {pooled.node})"
        )
    index = getattr(backend, "_index", None)
    dram = len(index.keys_in("dram")) if index is not None else 0
    ssd = len(index.keys_in("ssd")) if index is not None else 0
    return f"pages: dram={dram} ssd={ssd} (this process's tiers, no pool)"


def run(extra: Dict[str, Any], *, pages: int, layout: str, tokens_seed: Optional[int],
        load_only: bool = False, out: Any = sys.stdout) -> int:
    """Saves and loads ``pages`` toy pages through SGLang's controller with ``extra``; prints
    the outcome to ``out``; returns the exit status (0: every page byte-exact)."""
    from sglang.srt.managers.cache_controller import (
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # type: ignore[import-untyped]

    pool = toy_host_pool(layout, tokens=max(512, 4 * pages * 16))
    ctl = CpuController(pool)
    attach(ctl, dict(extra))
    try:
        backend = ctl.storage_backend
        page = ctl.page_size
        rng = random.Random(tokens_seed if tokens_seed is not None else os.urandom(16))
        toks = [rng.randrange(1, 1 << 30) for _ in range(pages * page)]
        hashes = get_storage_hash_str(toks, None, page_size=page)
        flat = pool.kv_buffer.view(-1).view(torch.uint8)
        gen = torch.Generator().manual_seed(rng.randrange(1 << 62))
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
        src = list(range(1, 1 + pages))

        def idx(ps: Sequence[int]) -> torch.Tensor:
            return torch.cat([torch.arange(p * page, (p + 1) * page, dtype=torch.int64) for p in ps])

        def data(p: int) -> bytes:
            return bytes(pool.get_data_page(p * page, flat=True).contiguous().view(torch.uint8).numpy())

        saved = [data(p) for p in src]
        size = len(saved[0])
        print(
            f"umbp.sglang check: {pages} toy pages of {size} bytes "
            f"(SGLang's MHA host pool, {layout}, {page} tokens a page)",
            file=out,
        )
        if not load_only:
            op = StorageOperation(idx(src), toks, hash_value=hashes)
            ctl._page_backup(op)
            print(f"saved: {op.completed_tokens // page}/{pages} pages", file=out)
        flat.zero_()
        prefetch = PrefetchOperation("umbp-check", toks)
        hit_hashes, hit_tokens = ctl._storage_hit_query(prefetch)
        print(f"hits: {hit_tokens // page}/{pages} pages", file=out)
        loaded = 0
        dst = list(range(1 + pages, 1 + 2 * pages))
        if hit_hashes:
            prefetch.hash_value = hit_hashes
            prefetch.host_indices = idx(dst[: len(hit_hashes)])
            loaded = ctl._page_transfer(prefetch)
        good = sum(1 for i in range(loaded) if data(dst[i]) == saved[i])
        print(f"loaded: {loaded}/{pages} pages, {good * size} bytes verified", file=out)
        if good != loaded:
            print(f"MISMATCH: {loaded - good} loaded page(s) differ from what was saved", file=out)
        print(_where(backend), file=out)
        return 0 if good == loaded == pages else 1
    finally:
        ctl.detach_storage_backend()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (see the module)."""
    parser = argparse.ArgumentParser(
        prog="python -m umbp.sglang.check",
        description="Runs an SGLang HiCache extra config with umbp.sglang through SGLang's "
        "own controller and host pool on CPU, saving and loading toy pages.",
    )
    parser.add_argument("config", help="the extra config file (JSON, YAML or TOML)")
    parser.add_argument("--pages", type=int, default=8, help="toy pages to save and load (8)")
    parser.add_argument(
        "--layout",
        default="page_first",
        choices=["layer_first", "page_first", "page_first_direct", "page_head"],
        help="the host pool's layout (--hicache-mem-layout; page_first)",
    )
    parser.add_argument("--tokens-seed", type=int, default=None,
                        help="repeat a run's tokens (default: fresh ones)")
    parser.add_argument("--load-only", action="store_true",
                        help="only query and load (pages an earlier run saved)")
    args = parser.parse_args(argv)
    if args.pages < 1:
        parser.error("--pages must be at least 1")
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # type: ignore[import-untyped]
        HybridCacheController,
    )

    try:
        # SGLang's own parser of the server argument (it takes SGLang's prefetch keys out).
        extra = HybridCacheController.parse_storage_backend_extra_config("@" + args.config)[0]
        return run(
            extra,
            pages=args.pages,
            layout=args.layout,
            tokens_seed=args.tokens_seed,
            load_only=args.load_only,
        )
    except (ValueError, RuntimeError, OSError, NotImplementedError, TypeError) as e:
        print(f"umbp.sglang.check: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
