"""One SGLang instance's storage side in a process of its own, for the pool tests
(test_sglang_pool.py): SGLang's own storage factory builds ``umbp.sglang.UmbpHiCacheStorage``
from an extra config, SGLang's MHA host pool is allocated on CPU, and SGLang's own controller
code (``_page_backup``, ``_storage_hit_query``, ``_page_transfer``, as in test_sglang.py)
saves or prefetches pages named by SGLang's own page hash.

    python sglang_instance.py save CONFIG_JSON PAGES SEED [--hold]
    python sglang_instance.py load CONFIG_JSON PAGES

``save`` fills the host pool from ``SEED`` and backs up host pages 1..PAGES; ``load`` queries
and prefetches the same token sequence into host pages 20.. of a zeroed pool. Each prints one
JSON line: ``saved_tokens`` or ``hit_tokens``/``loaded_pages``, ``sha`` (the SHA-256 of each
page saved or loaded, in order) and the backend's pool ``counters``. ``--hold`` keeps the
backend open until a line arrives on stdin (another instance reads its pages meanwhile).
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import (  # noqa: E402
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from test_sglang import (  # noqa: E402
    PAGE,
    _Controller,
    fill,
    host_pool,
    indices,
    page_bytes,
    storage_config,
)

DST = 20


def tokens(pages):
    """The token sequence whose pages are saved and prefetched."""
    return list(range(1000, 1000 + pages * PAGE))


def sha(data):
    return hashlib.sha256(data).hexdigest()


def open_backend(config):
    pool = host_pool()
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(config), pool)
    backend.register_mem_pool_host(pool)
    return pool, backend, _Controller(backend, pool, zero_copy=True)


def counters(backend):
    return backend.pooled.counters() if backend.pooled is not None else None


def main(argv):
    action, config, pages = argv[0], json.loads(argv[1]), int(argv[2])
    pool, backend, ctl = open_backend(config)
    try:
        toks = tokens(pages)
        hashes = get_storage_hash_str(toks, None, page_size=PAGE)
        if action == "save":
            fill(pool, seed=int(argv[3]))
            src = list(range(1, 1 + pages))
            op = StorageOperation(indices(src), toks, hash_value=hashes)
            ctl._page_backup(op)
            out = {
                "saved_tokens": op.completed_tokens,
                "sha": [sha(page_bytes(pool, p)) for p in src],
                "counters": counters(backend),
            }
        else:
            pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
            prefetch = PrefetchOperation("req", toks)
            hit_hashes, hit_tokens = ctl._storage_hit_query(prefetch)
            loaded = 0
            if hit_hashes:
                prefetch.hash_value = hit_hashes
                prefetch.host_indices = indices(range(DST, DST + len(hit_hashes)))
                loaded = ctl._page_transfer(prefetch)
            out = {
                "hit_tokens": hit_tokens,
                "loaded_pages": loaded,
                "sha": [sha(page_bytes(pool, DST + i)) for i in range(loaded)],
                "counters": counters(backend),
            }
        print(json.dumps(out), flush=True)
        if "--hold" in argv:
            sys.stdin.readline()
    finally:
        backend.close()


if __name__ == "__main__":
    main(sys.argv[1:])
