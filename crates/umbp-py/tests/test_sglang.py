"""umbp.sglang.UmbpHiCacheStorage against SGLang's own classes, on CPU.

The backend is built the way SGLang's cache controller builds it: through SGLang's
``StorageBackendFactory`` with ``--hicache-storage-backend dynamic`` (module path and class
name in the extra config), then ``register_mem_pool_host`` with SGLang's own MHA host memory
pool (``MHATokenToKVPoolHost``), allocated on CPU in each host layout SGLang offers for it.
Pages are moved with the calls SGLang's controller makes: ``batch_exists``, the zero-copy
``batch_get_v1`` / ``batch_set_v1`` (``"interface_v1": 1``), and the older ``batch_get`` /
``batch_set`` with the pool's flat data pages; and through the controller's own code
(``_page_backup``, ``_storage_hit_query``, ``_page_transfer``) on keys from SGLang's own page
hash, with the controller's state set up by hand since its constructor needs a GPU. Every
restored byte is compared with the bytes saved.

Needs SGLang (`bash .ci/sglang-venv` installs it into a cached virtual environment); skipped
with the reason printed where it is absent, and a failure where UMBP_REQUIRE_SGLANG=1.
"""

import errno
import os
import sys
import threading
from queue import Queue

import numpy as np
import pytest

try:
    import torch
    from sglang.srt.managers.cache_controller import (
        HiCacheController,
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("UMBP_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(
        f"SGLang is not installed ({e}); run: bash .ci/sglang-venv", allow_module_level=True
    )

import umbp
from umbp.sglang import SLOT_ALIGN, UmbpHiCacheStorage, UmbpStorageConfig
from umbp.sglang.check import toy_host_pool

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 16, 8  # a page: 2 x 3 x 8 x 2 x 16 bf16 = 3 KiB
DEVICE_TOKENS = 256
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def host_pool(layout="page_first", tokens=DEVICE_TOKENS):
    """SGLang's MHA host pool on CPU (unpinned: no GPU), twice the device pool's tokens."""
    return toy_host_pool(
        layout, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page=PAGE, tokens=tokens
    )


def mla_host_pool(layout="page_first", tokens=DEVICE_TOKENS):
    """SGLang's MLA host pool on CPU: one latent row (kv_lora_rank + rope dims) per token."""
    rank, rope = 32, 16
    bufs = tuple(torch.zeros(tokens, 1, rank + rope, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        kv_cache_dim=rank + rope,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )


def storage_config(extra, *, tp_rank=0, tp_size=1, mla=False, layout="page_first"):
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name="test-model",
        extra_config=extra,
    )


def extra(**ours):
    return {
        "backend_name": "umbp",
        "module_path": "umbp.sglang",
        "class_name": "UmbpHiCacheStorage",
        "interface_v1": 1,
        **ours,
    }


def attach(pool, layout="page_first", mla=False, **ours):
    """What SGLang's HiCacheController.attach_storage_backend does with a dynamic backend."""
    config = storage_config(extra(**ours), layout=layout, mla=mla)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill(pool, seed=1):
    """Random bytes in the whole host pool."""
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, flat.numel(), dtype=np.uint8)))


def page_bytes(pool, page):
    """The bytes of host page ``page`` (all layers, K and V), as SGLang's get_data_page sees them."""
    return pool.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def indices(pages):
    """Host token indices of the host pages ``pages`` (page_size each), as SGLang passes them."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_the_factory_in_every_layout(tmp_path, layout):
    pool = host_pool(layout)
    backend = attach(pool, layout, dram_bytes=1 << 20, ssd_path=str(tmp_path / "t"), ssd_bytes=1 << 20)
    try:
        assert isinstance(backend, UmbpHiCacheStorage)  # SGLang's own dynamic loading built it
        fill(pool)
        n = pool.page_num // 2 - 1
        src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
        keys = [f"hash-{layout}-{i}" for i in range(n)]
        saved = [page_bytes(pool, p) for p in src]
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, indices(src)) == [True] * n
        assert backend.batch_exists(keys) == n and all(backend.exists(k) for k in keys)
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        assert backend.batch_get_v1(keys, indices(dst)) == [True] * n
        assert [page_bytes(pool, p) for p in dst] == saved
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_round_trip_of_an_mla_host_pool(tmp_path, layout):
    pool = mla_host_pool(layout)
    backend = attach(pool, layout, mla=True, dram_bytes=4 * SLOT_ALIGN, ssd_path=str(tmp_path / "l"), ssd_bytes=1 << 20)
    try:
        assert backend.object_bytes == LAYERS * PAGE * 48 * 2  # one latent row per token
        fill(pool, seed=9)
        keys = [f"mla-{i}" for i in range(10)]
        saved = [page_bytes(pool, p) for p in range(1, 11)]
        assert backend.batch_set_v1(keys, indices(range(1, 11))) == [True] * 10
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        assert backend.batch_get_v1(keys, indices(range(12, 22))) == [True] * 10
        assert [page_bytes(pool, p) for p in range(12, 22)] == saved
    finally:
        backend.close()


def test_dram_only_keeps_the_newest_pages(tmp_path):
    # No SSD tier: a save makes room by dropping the least recently used pages.
    pool = host_pool()
    backend = attach(pool, dram_bytes=4 * SLOT_ALIGN)
    try:
        fill(pool, seed=10)
        for round_ in range(4):
            ks = [f"d{round_}-{j}" for j in range(3)]
            assert backend.batch_set_v1(ks, indices(range(1 + 3 * round_, 4 + 3 * round_))) == [True] * 3
        assert backend.batch_exists(["d3-0", "d3-1", "d3-2"]) == 3
        assert backend.batch_exists(["d0-0"]) == 0 and backend.batch_exists(["d1-0"]) == 0
        newest = page_bytes(pool, 10)
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        assert backend.batch_get_v1(["d3-0", "d0-0"], indices([20, 21])) == [True, False]
        assert page_bytes(pool, 20) == newest
    finally:
        backend.close()


def test_many_keys_over_dram_and_ssd_with_demotions(tmp_path):
    # 4 DRAM slots: most pages are demoted to (or saved straight into) the SSD file.
    pool = host_pool(tokens=1024)
    backend = attach(pool, dram_bytes=4 * SLOT_ALIGN, ssd_path=str(tmp_path / "s"), ssd_bytes=1 << 20)
    try:
        fill(pool, seed=2)
        rng = np.random.default_rng(3)
        keys, saved = [], {}
        for round_ in range(6):  # batches as SGLang's backup thread sends them
            pages = list(range(1 + 20 * round_, 21 + 20 * round_))
            ks = [f"k{round_}-{p}" for p in pages]
            assert backend.batch_set_v1(ks, indices(pages)) == [True] * len(ks)
            keys += ks
            saved.update({k: page_bytes(pool, p) for k, p in zip(ks, pages)})
        tiers = [backend._index.entry(k).tier for k in keys]
        assert tiers.count("ssd") >= len(keys) - 4 and tiers.count("dram") >= 1
        m = backend.engine.metrics()
        assert m["engines"][("ssd", "host->file")]["objects"] >= len(keys) - 4
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        order = list(rng.permutation(len(keys)))
        for start in range(0, len(order), 25):
            chunk = [keys[i] for i in order[start : start + 25]]
            dst = list(range(1, 1 + len(chunk)))
            assert backend.batch_get_v1(chunk, indices(dst)) == [True] * len(chunk)
            assert [page_bytes(pool, p) for p in dst] == [saved[k] for k in chunk]
        assert backend.engine.metrics()["checksums"]["mismatches"] == 0
    finally:
        backend.close()


def test_missing_keys_fail_alone_and_leave_their_pages_untouched(tmp_path):
    pool = host_pool()
    backend = attach(pool, dram_bytes=1 << 20)
    try:
        fill(pool, seed=4)
        stored = [f"s{i}" for i in range(6)]
        saved = [page_bytes(pool, p) for p in range(1, 7)]
        assert backend.batch_set_v1(stored, indices(range(1, 7))) == [True] * 6
        asked = ["s0", "nope-1", "s2", "s3", "nope-2", "s5"]
        assert backend.batch_exists(asked) == 1  # the consecutive hits from the start
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0xAB
        sentinel = page_bytes(pool, 10)
        dst = list(range(10, 16))
        assert backend.batch_get_v1(asked, indices(dst)) == [True, False, True, True, False, True]
        got = [page_bytes(pool, p) for p in dst]
        assert got[0] == saved[0] and got[2] == saved[2] and got[3] == saved[3] and got[5] == saved[5]
        assert got[1] == sentinel and got[4] == sentinel
        # A key saved twice stays one copy, reported saved.
        assert backend.batch_set_v1(["s1", "new"], indices([1, 2])) == [True, True]
        # Host indices that do not cover the keys' pages: every key fails, nothing is dropped.
        assert backend.batch_get_v1(["s0", "s2"], indices([3])) == [False, False]
        assert backend.batch_exists(["s0", "s1", "s2"]) == 3
    finally:
        backend.close()


def test_a_corrupted_ssd_slot_fails_that_key_only(tmp_path):
    pool = host_pool()
    path = tmp_path / "ssd"
    backend = attach(pool, dram_bytes=0, ssd_path=str(path), ssd_bytes=1 << 20)
    try:
        fill(pool, seed=5)
        keys = [f"c{i}" for i in range(8)]
        saved = [page_bytes(pool, p) for p in range(1, 9)]
        assert backend.batch_set_v1(keys, indices(range(1, 9))) == [True] * 8
        entry = backend._index.entry("c3")
        assert entry.tier == "ssd"
        # Flip bytes of c3's slot behind umbp's back (another writer, a bad sector).
        with open(path, "r+b") as f:
            f.seek(entry.slot * backend.slot_bytes + 100)
            f.write(b"\xff\x00" * 32)
            f.flush()
            os.fsync(f.fileno())
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        dst = list(range(20, 28))
        ok = backend.batch_get_v1(keys, indices(dst))
        assert ok == [True, True, True, False, True, True, True, True]
        got = [page_bytes(pool, p) for p in dst]
        assert [g for i, g in enumerate(got) if i != 3] == [s for i, s in enumerate(saved) if i != 3]
        assert backend.engine.metrics()["checksums"]["mismatches"] == 1
        # The index forgot the bad copy: a miss now, saved anew later.
        assert not backend.exists("c3") and backend.batch_exists(keys) == 3
        fill(pool, seed=5)  # page 4 holds c3's bytes again
        assert backend.batch_set_v1(["c3"], indices([4])) == [True]
        assert backend.batch_get_v1(["c3"], indices([30])) == [True]
        assert page_bytes(pool, 30) == saved[3]
    finally:
        backend.close()


def test_all_tiers_checksums_catch_a_corrupted_dram_slot(tmp_path):
    pool = host_pool()
    backend = attach(pool, dram_bytes=1 << 20, checksums="all_tiers")
    try:
        fill(pool, seed=11)
        keys = [f"a{i}" for i in range(4)]
        assert backend.batch_set_v1(keys, indices(range(1, 5))) == [True] * 4
        entry = backend._index.entry("a2")
        assert entry.tier == "dram"
        backend._arena[entry.slot * backend.slot_bytes + 7] ^= 0x5A  # a bit flip in host memory
        assert backend.batch_get_v1(keys, indices(range(10, 14))) == [True, True, False, True]
        assert backend.engine.metrics()["checksums"]["mismatches"] == 1
    finally:
        backend.close()


def test_a_second_instance_on_the_same_ssd_file_is_refused(tmp_path):
    path = str(tmp_path / "shared")
    first = attach(host_pool(), dram_bytes=0, ssd_path=path, ssd_bytes=1 << 20)
    try:
        second = UmbpHiCacheStorage(
            storage_config(extra(dram_bytes=1 << 20, ssd_path=path, ssd_bytes=1 << 20))
        )
        with pytest.raises(RuntimeError, match="in use by another instance") as e:
            second.register_mem_pool_host(host_pool())
        assert isinstance(e.value.__cause__, umbp.RegistrationError)
        assert e.value.__cause__.errno == errno.EWOULDBLOCK
        assert second.dram is None  # what it had opened is closed again
    finally:
        first.close()
    # Once the first closed, the file is free again.
    third = attach(host_pool(), dram_bytes=0, ssd_path=path, ssd_bytes=1 << 20)
    third.close()


def test_ranks_get_files_of_their_own(tmp_path):
    cfg = UmbpStorageConfig.from_extra(extra(ssd_path=str(tmp_path / "f"), ssd_bytes=1 << 20))
    assert cfg.ssd_file(storage_config({}, tp_rank=1, tp_size=2)) == str(tmp_path / "f.tp1")
    assert cfg.ssd_file(storage_config({})) == str(tmp_path / "f")
    cfg = UmbpStorageConfig.from_extra(extra(ssd_path=str(tmp_path / "r{tp_rank}"), ssd_bytes=1 << 20))
    assert cfg.ssd_file(storage_config({}, tp_rank=1, tp_size=2)) == str(tmp_path / "r1")


def test_bad_configuration_is_refused_by_name():
    with pytest.raises(ValueError, match="ssd_byts"):
        UmbpStorageConfig.from_extra(extra(ssd_byts=1))
    with pytest.raises(ValueError, match="ssd_path needs ssd_bytes"):
        UmbpStorageConfig.from_extra(extra(ssd_path="/tmp/x"))
    with pytest.raises(ValueError, match="checksums"):
        UmbpStorageConfig.from_extra(extra(checksums="sometimes"))
    with pytest.raises(ValueError, match="dram_bytes"):
        UmbpStorageConfig.from_extra(extra(dram_bytes=-1))
    with pytest.raises(ValueError, match="MLA"):
        UmbpHiCacheStorage(storage_config(extra(), tp_size=2, mla=True))


def test_the_tensor_per_page_interface_without_interface_v1(tmp_path):
    # What SGLang's _generic_page_set / _generic_page_get do when interface_v1 is not set.
    pool = host_pool("layer_first")
    backend = attach(pool, "layer_first", dram_bytes=1 << 20, ssd_path=str(tmp_path / "g"), ssd_bytes=1 << 20)
    try:
        fill(pool, seed=6)
        keys = [f"g{i}" for i in range(5)]
        saved = [page_bytes(pool, p) for p in range(1, 6)]
        data = [pool.get_data_page(p * PAGE) for p in range(1, 6)]
        assert backend.batch_set(keys, data) is True
        dummies = [pool.get_dummy_flat_data_page() for _ in range(6)]
        got = backend.batch_get(keys + ["missing"], dummies)
        assert got[5] is None and all(g is d for g, d in zip(got[:5], dummies))
        for i, page in enumerate(range(10, 15)):
            pool.set_from_flat_data_page(page * PAGE, got[i])
        assert [page_bytes(pool, p) for p in range(10, 15)] == saved
        assert backend.get("g0", pool.get_dummy_flat_data_page()) is not None
        assert backend.set("g9", pool.get_data_page(7 * PAGE)) is True and backend.exists("g9")
    finally:
        backend.close()


def test_sixteen_threads_at_once(tmp_path):
    # SGLang calls a backend from its prefetch, prefetch I/O and backup threads at once.
    pool = host_pool(tokens=2048)
    backend = attach(pool, dram_bytes=64 * SLOT_ALIGN, ssd_path=str(tmp_path / "m"), ssd_bytes=4 << 20)
    fill(pool, seed=7)
    threads_n, pages_per = 16, 12  # each thread its own host pages: 2 x 12 of them
    saved = {}
    for t in range(threads_n):
        for j in range(pages_per):
            saved[f"t{t}-{j}"] = page_bytes(pool, 1 + t * 2 * pages_per + j)
    errors = []
    barrier = threading.Barrier(threads_n)

    def work(t):
        try:
            base = 1 + t * 2 * pages_per
            src = list(range(base, base + pages_per))
            dst = list(range(base + pages_per, base + 2 * pages_per))
            keys = [f"t{t}-{j}" for j in range(pages_per)]
            barrier.wait()
            for round_ in range(4):
                assert backend.batch_set_v1(keys, indices(src)) == [True] * pages_per
                assert backend.batch_exists(keys) == pages_per
                assert backend.batch_get_v1(keys, indices(dst)) == [True] * pages_per
                got = [page_bytes(pool, p) for p in dst]
                assert got == [saved[k] for k in keys], f"thread {t} round {round_}"
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    try:
        assert not any(th.is_alive() for th in threads), "a thread never finished"
        assert not errors, errors[0]
        assert backend.engine.metrics()["checksums"]["mismatches"] == 0
    finally:
        backend.close()


def test_closed_backend_refuses_calls(tmp_path):
    pool = host_pool()
    backend = attach(pool, dram_bytes=1 << 20)
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_exists(["a"])


class _Controller(HiCacheController):
    """SGLang's HiCacheController with only the state its storage methods read, so that its
    own code (``_page_backup``, ``_storage_hit_query``, ``_page_transfer`` and the page
    get/set functions ``attach_storage_backend`` picks) runs against the backend without the
    GPU its constructor needs."""

    def __init__(self, backend, pool, zero_copy):  # no super().__init__: it needs a GPU
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = pool
        self.page_size = PAGE
        self.prefetch_sync_queue = Queue()
        if zero_copy:  # what attach_storage_backend picks for "interface_v1": 1
            self.page_get_func = self._page_get_zero_copy
            self.page_set_func = self._page_set_zero_copy
        else:
            self.page_get_func = self._generic_page_get
            self.page_set_func = self._generic_page_set


@pytest.mark.parametrize("zero_copy", [True, False], ids=["interface_v1", "tensor_per_page"])
def test_sglang_controller_code_saves_finds_and_prefetches(tmp_path, monkeypatch, zero_copy):
    # SGLang hashes pages with a C++ extension that torch builds on first use with the venv's
    # ninja, found on PATH as in an activated venv (a server runs in one).
    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ.get("PATH", ""))
    pool = host_pool()
    ours = dict(dram_bytes=8 * SLOT_ALIGN, ssd_path=str(tmp_path / "c"), ssd_bytes=1 << 20)
    if not zero_copy:
        ours_extra = {k: v for k, v in extra(**ours).items() if k != "interface_v1"}
        config = storage_config(ours_extra)
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)
    else:
        backend = attach(pool, **ours)
    try:
        ctl = _Controller(backend, pool, zero_copy)
        fill(pool, seed=8)
        pages = 12
        tokens = list(range(1000, 1000 + pages * PAGE))
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)  # SGLang's page keys
        assert len(hashes) == pages
        src = list(range(1, 1 + pages))
        saved = [page_bytes(pool, p) for p in src]
        backup = StorageOperation(indices(src), tokens, hash_value=hashes)
        ctl._page_backup(backup)
        assert backup.completed_tokens == pages * PAGE

        # A later request sharing the first 12 pages and going on for 3 more.
        longer = tokens + list(range(5000, 5000 + 3 * PAGE))
        prefetch = PrefetchOperation("req-1", longer)
        hit_hashes, hit_tokens = ctl._storage_hit_query(prefetch)
        assert hit_hashes == hashes and hit_tokens == pages * PAGE

        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        dst = list(range(20, 20 + pages))
        prefetch.hash_value = hit_hashes
        prefetch.host_indices = indices(dst)
        assert ctl._page_transfer(prefetch) == pages
        assert [page_bytes(pool, p) for p in dst] == saved
    finally:
        backend.close()
