"""umbp.sglang.UmbpHiCacheStorage on the pool (``"pool"`` in the extra config), through
SGLang's own storage factory, host pool and controller code, on CPU.

Instances are separate processes (tests/sglang_instance.py, each with its own backend): two
sharing a real redis-server (tests/redis_server.py), one saving and the other hitting and
loading byte-exact pages; a restart over the embedded index (a process saves and exits, a new
one hits); memory nodes (real ``umbp-ucx-serve`` processes, tests/memory_node.py) taking the
saves of one process and serving another's hits. Hostile cases: a page whose bytes changed on
disk fails only its key; the Redis index flushed mid-run costs hits, never bytes. And the
extra config SGLang's decode-side KV offload hands over raw (with SGLang's own keys in it).

Needs SGLang (skipped without it, or failing where UMBP_REQUIRE_SGLANG=1), redis-server
(likewise, UMBP_REQUIRE_REDIS=1) and, for the memory-node test, umbp-ucx-serve and UCX
(UMBP_REQUIRE_UCX=1).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_sglang import (  # skips the module where SGLang is absent
    PAGE,
    fill,
    host_pool,
    indices,
    page_bytes,
    storage_config,
)
import torch  # noqa: E402  (after the skip above)

from memory_node import memory_node  # noqa: F401  (the fixture)
from redis_server import PASSWORD, redis  # noqa: F401  (the fixture)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from umbp.sglang import SGLANG_KEYS, UmbpStorageConfig
from umbp.sglang.check import CpuController, attach

HERE = Path(__file__).resolve().parent
PAGES = 6


def env():
    """The children's environment: the venv's bin on PATH (SGLang's page hash builds a C++
    extension with its ninja on first use)."""
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def ours(**kw):
    return {
        "backend_name": "umbp",
        "module_path": "umbp.sglang",
        "class_name": "UmbpHiCacheStorage",
        "interface_v1": 1,
        **kw,
    }


def run(action, config, *args):
    """Runs one instance to completion; its JSON line."""
    r = subprocess.run(
        [sys.executable, str(HERE / "sglang_instance.py"), action, json.dumps(config), str(PAGES), *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


class Held:
    """An instance that saved and stays open (its node alive) until :meth:`close`."""

    def __init__(self, config, seed):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "sglang_instance.py"), "save", json.dumps(config), str(PAGES), str(seed), "--hold"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(self.proc.stderr.read()[-4000:])
        self.out = json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read()[-4000:]


def test_two_processes_share_pages_through_redis(tmp_path, redis):
    a = Held(ours(pool=redis.url, ssd_path=str(tmp_path / "a.ssd"), ssd_bytes=1 << 20, dram_bytes=0), seed=3)
    try:
        assert a.out["saved_tokens"] == PAGES * PAGE
        # page_first: a page is two runs (its K and its V), each a block in A's SSD file.
        assert a.out["counters"]["stored"]["ssd"] == 2 * PAGES
        b = run("load", ours(pool=redis.url, ssd_path=str(tmp_path / "b.ssd"), ssd_bytes=1 << 20))
    finally:
        a.close()
    assert b["hit_tokens"] == PAGES * PAGE and b["loaded_pages"] == PAGES
    assert b["sha"] == a.out["sha"]
    assert b["counters"]["loaded"]["peer_file"] == 2 * PAGES
    assert b["counters"]["loaded"]["failed"] == 0
    # A left the pool when it closed: its pages are misses now, never failures.
    c = run("load", ours(pool=redis.url, dram_bytes=1 << 20))
    assert c["hit_tokens"] == 0 and c["loaded_pages"] == 0


def test_a_restart_over_the_embedded_pool_hits_what_the_last_run_saved(tmp_path):
    config = ours(pool="embedded", ssd_path=str(tmp_path / "kv.ssd"), ssd_bytes=1 << 20, dram_bytes=0)
    saved = run("save", config, "5")
    assert saved["saved_tokens"] == PAGES * PAGE
    assert saved["counters"]["stored"]["ssd"] == 2 * PAGES
    assert (tmp_path / "kv.ssd.pool.redb").exists()
    again = run("load", config)
    assert again["hit_tokens"] == PAGES * PAGE and again["loaded_pages"] == PAGES
    assert again["sha"] == saved["sha"]
    assert again["counters"]["loaded"]["own"] == 2 * PAGES
    # Another shape (namespace) over the same files never hits those pages.
    other = run("load", {**config, "pool_namespace": "another-model-revision"})
    assert other["hit_tokens"] == 0


def test_saves_land_on_a_memory_node_and_another_process_hits_them(tmp_path, redis, memory_node):
    node = memory_node(node_id=9101, slot_size=4096, slots=64)
    reach = dict(pool=redis.url, remote_secret_file=str(node.secret_file), remote_transports="tcp")
    saved = run("save", ours(**reach, pool_save_to="memory_nodes_only", dram_bytes=0), "7")
    assert saved["saved_tokens"] == PAGES * PAGE
    assert saved["counters"]["stored"]["memory_node"] == 2 * PAGES
    # The saver is gone; the node keeps the pages. A DRAM-only instance reads them.
    got = run("load", ours(**reach, dram_bytes=1 << 20))
    assert got["hit_tokens"] == PAGES * PAGE and got["loaded_pages"] == PAGES
    assert got["sha"] == saved["sha"]
    assert got["counters"]["loaded"]["memory_node"] == 2 * PAGES


def open_backend(host, **kw):
    """The backend as SGLang's controller attaches it, with our keys ``kw``."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(ours(**kw)), host)
    backend.register_mem_pool_host(host)
    return backend


def keys(n=PAGES):
    return [f"page-{i}" for i in range(n)]


def test_a_page_changed_on_disk_fails_only_its_key(tmp_path):
    pool = host_pool()
    ssd = tmp_path / "kv.ssd"
    backend = open_backend(pool, pool="embedded", ssd_path=str(ssd), ssd_bytes=1 << 20, dram_bytes=0)
    try:
        fill(pool, seed=11)
        src = list(range(1, 1 + PAGES))
        saved = [page_bytes(pool, p) for p in src]
        assert backend.batch_set_v1(keys(), indices(src)) == [True] * PAGES
        # Flip a byte of page 2's V run in the SSD file, where the index says it lies.
        pp = backend.pooled
        placement = pp.index.lookup([pp.pool_keys(keys()[2])[1]])[0]
        with open(ssd, "r+b") as f:
            at = placement.slot * pp.slot_bytes + 100
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        pool.kv_buffer.view(-1).view(torch.uint8)[:] = 0
        dst = list(range(30, 30 + PAGES))
        got = backend.batch_get_v1(keys(), indices(dst))
        assert got == [True, True, False, True, True, True]
        for i, p in enumerate(dst):
            if got[i]:
                assert page_bytes(pool, p) == saved[i]
        # The bad block left the pool: the key is a miss now (SGLang recomputes it).
        assert backend.batch_exists(keys()) == 2
        assert backend.pooled.counters()["pool"]["checksum_failures"] == 1
    finally:
        backend.close()


def flushall(redis):
    with socket.create_connection(("127.0.0.1", redis.port), timeout=5) as s:
        s.sendall(f"AUTH {PASSWORD}\r\nFLUSHALL\r\n".encode())
        got = b""
        while got.count(b"+OK") < 2:
            more = s.recv(64)
            assert more, got
            got += more


def test_the_redis_index_flushed_mid_run_costs_hits_never_bytes(tmp_path, redis):
    pool = host_pool()
    backend = open_backend(pool, pool=redis.url, dram_bytes=1 << 20)
    try:
        fill(pool, seed=12)
        src = list(range(1, 1 + PAGES))
        saved = [page_bytes(pool, p) for p in src]
        assert backend.batch_set_v1(keys(), indices(src)) == [True] * PAGES
        assert backend.batch_exists(keys()) == PAGES
        flushall(redis)
        assert backend.batch_exists(keys()) == 0
        pool.kv_buffer.view(-1).view(torch.uint8)[30 * PAGE :] = 0
        dst = list(range(30, 30 + PAGES))
        blank = page_bytes(pool, dst[0])
        assert backend.batch_get_v1(keys(), indices(dst)) == [False] * PAGES
        assert all(page_bytes(pool, p) == blank for p in dst)  # nothing was written
        # Saving again: whatever the index took is served byte-exact, the rest misses.
        again = backend.batch_set_v1(keys(), indices(src))
        got = backend.batch_get_v1(keys(), indices(dst))
        for i, p in enumerate(dst):
            assert not got[i] or page_bytes(pool, p) == saved[i]
            assert got[i] <= again[i]
    finally:
        backend.close()


def test_sglangs_own_keys_pass_and_typos_are_refused():
    cfg = UmbpStorageConfig.from_extra(
        ours(
            dram_bytes=1 << 20,
            prefetch_threshold=128,
            prefetch_timeout_base=2,
            prefetch_timeout_per_ki_token=0.5,
            hicache_storage_pass_prefix_keys=True,
            tp_lcm_size=4,
        )
    )
    assert cfg.dram_bytes == 1 << 20
    with pytest.raises(ValueError, match=r"unknown extra-config keys \['prefetch_treshold'\]"):
        UmbpStorageConfig.from_extra(ours(dram_bytes=1 << 20, prefetch_treshold=128))
    with pytest.raises(ValueError, match="pool_save_to"):
        UmbpStorageConfig.from_extra(ours(dram_bytes=1 << 20, pool_save_to="elsewhere"))
    with pytest.raises(ValueError, match="embedded pool .* needs ssd_path"):
        UmbpStorageConfig.from_extra(ours(dram_bytes=1 << 20, pool="embedded"))
    with pytest.raises(ValueError, match="pool_node"):
        UmbpStorageConfig.from_extra(ours(dram_bytes=1 << 20, pool="redis://x:1/", pool_node=-1))


def test_sglangs_own_keys_are_the_ones_its_source_reads():
    """Every key SGLang's controllers pop from the extra config is one the backend leaves to
    SGLang (read from SGLang's source, so a new one shows up here)."""
    import inspect
    import re

    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller

    popped = set()
    for module in (cache_controller, hybrid_cache_controller):
        popped |= set(re.findall(r"extra_config\.pop\(\s*\"(\w+)\"", inspect.getsource(module)))
    assert popped and popped <= SGLANG_KEYS, popped - SGLANG_KEYS


def test_the_decode_side_offload_hands_the_raw_config_to_sglangs_controller(tmp_path, monkeypatch):
    """SGLang's decode-side KV offload (DecodeKVCacheOffloadManager) json-loads the server's
    extra config and hands it, SGLang's own prefetch keys still in it, to HiCacheController,
    whose attach_storage_backend builds the backend. The manager itself needs a GPU model
    runner; this runs what it does from there on: the same json.loads of the server argument,
    then SGLang's own attach_storage_backend (its storage-config builder, its factory, its
    storage threads) on a CPU controller, then its backup, hit query and prefetch."""
    import inspect

    from sglang.srt.disaggregation import decode_kvcache_offload_manager as manager
    from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    monkeypatch.setenv("PATH", env()["PATH"])  # SGLang's page hash builds with the venv's ninja
    source = inspect.getsource(manager.DecodeKVCacheOffloadManager.__init__)
    assert "json.loads(" in source
    assert "storage_backend_extra_config=hicache_storage_backend_extra_config" in source
    raw = json.dumps(
        ours(
            pool="embedded",
            ssd_path=str(tmp_path / "d.ssd"),
            ssd_bytes=1 << 20,
            dram_bytes=0,
            prefetch_threshold=64,
            prefetch_timeout_base=1,
            prefetch_timeout_per_ki_token=0.25,
            hicache_storage_pass_prefix_keys=False,
        )
    )
    pool = host_pool()
    ctl = CpuController(pool)
    attach(ctl, json.loads(raw))  # what the manager's controller does with it
    try:
        backend = ctl.storage_backend
        assert backend.pooled is not None
        assert backend.storage_config.extra_config["prefetch_threshold"] == 64  # not popped
        fill(pool, seed=13)
        toks = list(range(7000, 7000 + 2 * PAGE))
        hashes = get_storage_hash_str(toks, None, page_size=PAGE)
        saved = [page_bytes(pool, p) for p in (1, 2)]
        op = StorageOperation(indices([1, 2]), toks, hash_value=hashes)
        ctl._page_backup(op)
        assert op.completed_tokens == 2 * PAGE
        prefetch = PrefetchOperation("decode", toks)
        hit_hashes, hit_tokens = ctl._storage_hit_query(prefetch)
        assert hit_tokens == 2 * PAGE
        prefetch.hash_value, prefetch.host_indices = hit_hashes, indices([40, 41])
        assert ctl._page_transfer(prefetch) == 2
        assert [page_bytes(pool, p) for p in (40, 41)] == saved
    finally:
        ctl.detach_storage_backend()


def check(config_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "umbp.sglang.check", str(config_path), *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )


def test_the_check_command_reports_hits_bytes_and_where_blocks_went(tmp_path):
    config = tmp_path / "umbp.json"
    config.write_text(
        json.dumps(
            ours(pool="embedded", ssd_path=str(tmp_path / "kv.ssd"), ssd_bytes=4 << 20, dram_bytes=0,
                 prefetch_threshold=64)
        )
    )
    r = check(config, "--pages", "5", "--tokens-seed", "9")
    assert r.returncode == 0, r.stderr[-4000:]
    # The toy page: 2 layers x (K, V) x 16 tokens x 2 heads x 64 dims x 2 bytes.
    page = 2 * 2 * 16 * 2 * 64 * 2
    assert f"toy pages of {page} bytes" in r.stdout
    assert "saved: 5/5 pages" in r.stdout
    assert "hits: 5/5 pages" in r.stdout
    assert f"loaded: 5/5 pages, {5 * page} bytes verified" in r.stdout
    assert "blocks: dram=0 ssd=10 memory_node=0 present=0 (pool embedded" in r.stdout
    # A second run over the embedded pool hits the first one's pages (load only).
    again = check(config, "--pages", "5", "--tokens-seed", "9", "--load-only")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "hits: 5/5 pages" in again.stdout and f"{5 * page} bytes verified" in again.stdout
    # Without a pool: this process's tiers.
    local = tmp_path / "local.json"
    local.write_text(json.dumps(ours(dram_bytes=1 << 20)))
    r = check(local, "--pages", "3")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "hits: 3/3 pages" in r.stdout and "pages: dram=3 ssd=0" in r.stdout


def test_the_check_command_refuses_a_bad_config_with_the_error(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps(ours(dram_bytes=1 << 20, pool_sav_to="local")))
    r = check(config)
    assert r.returncode == 2
    assert "umbp.sglang.check: error:" in r.stderr and "'pool_sav_to'" in r.stderr
    config.write_text(json.dumps(ours(dram_bytes=1 << 20, pool="embedded")))
    r = check(config)
    assert r.returncode == 2 and "needs ssd_path" in r.stderr
    r = check(tmp_path / "absent.json")
    assert r.returncode == 2 and "absent.json" in r.stderr


def test_an_mla_models_ranks_share_the_pages_one_rank_saved(tmp_path, redis):
    """SGLang saves an MLA model's pages from one rank only; on a pool its ranks share keys,
    so rank 1 hits and loads (from rank 0's SSD file) what rank 0 saved."""
    from test_sglang import mla_host_pool

    pools = [mla_host_pool(), mla_host_pool()]
    backends = []
    for rank, host in enumerate(pools):
        extra = ours(pool=redis.url, ssd_path=str(tmp_path / "mla"), ssd_bytes=1 << 20, dram_bytes=0)
        config = storage_config(extra, tp_rank=rank, tp_size=2, mla=True)
        b = StorageBackendFactory.create_backend("dynamic", config, host)
        b.register_mem_pool_host(host)
        backends.append(b)
    try:
        fill(pools[0], seed=14)
        src = list(range(1, 1 + PAGES))
        saved = [page_bytes(pools[0], p) for p in src]
        assert backends[0].batch_set_v1(keys(), indices(src)) == [True] * PAGES
        assert backends[1].batch_exists(keys()) == PAGES
        dst = list(range(30, 30 + PAGES))
        assert backends[1].batch_get_v1(keys(), indices(dst)) == [True] * PAGES
        assert [page_bytes(pools[1], p) for p in dst] == saved
    finally:
        for b in backends:
            b.close()


def test_eight_threads_save_query_and_load_at_once_over_the_pool(tmp_path):
    """SGLang's prefetch and backup threads call at once: each thread saves, queries and
    loads its own pages over one embedded pool; every page comes back byte-exact."""
    import threading

    pool = host_pool(tokens=1024)
    backend = open_backend(pool, pool="embedded", ssd_path=str(tmp_path / "kv.ssd"), ssd_bytes=4 << 20, dram_bytes=0)
    fill(pool, seed=15)
    errors = []

    def work(t):
        try:
            src = [1 + 4 * t + i for i in range(4)]
            dst = [64 + 4 * t + i for i in range(4)]
            ks = [f"t{t}-{i}" for i in range(4)]
            want = [page_bytes(pool, p) for p in src]
            for _ in range(3):
                assert backend.batch_set_v1(ks, indices(src)) == [True] * 4
                assert backend.batch_exists(ks) == 4
                assert backend.batch_get_v1(ks, indices(dst)) == [True] * 4
                assert [page_bytes(pool, p) for p in dst] == want
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[0]
        c = backend.pooled.counters()
        assert c["stored"]["ssd"] == 8 * 4 * 2  # each page's two runs, stored once
        assert c["stored"]["present"] == 2 * 8 * 4 * 2  # the repeats
        assert c["loaded"]["own"] == 3 * 8 * 4 * 2 and c["loaded"]["failed"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_tensor_per_page_interface_over_the_pool(tmp_path, layout):
    """Without interface_v1 SGLang hands a tensor per page (get_data_page /
    get_dummy_flat_data_page): each is cut into the same runs as the host pool's pages."""
    pool = host_pool(layout)
    extra = {k: v for k, v in ours(pool="embedded", ssd_path=str(tmp_path / "g"), ssd_bytes=1 << 20, dram_bytes=0).items() if k != "interface_v1"}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=layout), pool)
    backend.register_mem_pool_host(pool)
    try:
        fill(pool, seed=16)
        ks = keys(5)
        saved = [page_bytes(pool, p) for p in range(1, 6)]
        assert backend.batch_set(ks, [pool.get_data_page(p * PAGE) for p in range(1, 6)]) is True
        assert backend.batch_exists(ks) == 5
        dummies = [pool.get_dummy_flat_data_page() for _ in range(6)]
        got = backend.batch_get(ks + ["missing"], dummies)
        assert got[5] is None and all(g is d for g, d in zip(got[:5], dummies))
        for i, page in enumerate(range(10, 15)):
            pool.set_from_flat_data_page(page * PAGE, got[i])
        assert [page_bytes(pool, p) for p in range(10, 15)] == saved
    finally:
        backend.close()
    # An instance with interface_v1 lays a page out as the host pool's runs, not as the flat
    # data page (another byte order in layer_first): it never hits these pages.
    zero_copy = open_backend(pool, pool="embedded", ssd_path=str(tmp_path / "g"), ssd_bytes=1 << 20, dram_bytes=0)
    try:
        assert zero_copy.batch_exists(ks) == 0
        assert zero_copy.batch_get_v1(ks, indices(range(20, 25))) == [False] * 5
    finally:
        zero_copy.close()
