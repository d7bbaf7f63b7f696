"""umbp.vllm.UmbpConnector with a pool (issue 36): vLLM's own scheduler and workers on CPU, as
in test_vllm.py (whose harness this reuses), with the connector's index in the pool instead
of in the process.

Real components only: a redis-server started here on loopback (a password, a fresh port, a
temp dir) and stopped at the end; instances are separate processes (one is a child process
started by the test, the other the test's own), each with vLLM's scheduler and its workers,
sharing that Redis; the embedded index is a redb file beside the SSD tier. Every loaded byte
is checked against what its token prefix implies (test_vllm.Harness).

Memory nodes are real ``umbp-ucx-serve`` processes joining that Redis (tests/memory_node.py
builds the binary with cargo); instances reach them with the remote engine over TCP.

Needs vLLM (skipped with the reason printed where it is absent, a failure with
UMBP_REQUIRE_VLLM=1), for the Redis tests redis-server (likewise, UMBP_REQUIRE_REDIS=1), and
for the memory-node tests umbp-ucx-serve and UCX (likewise, UMBP_REQUIRE_UCX=1).
"""

import json
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import pytest

# First: it skips this module (or fails, with UMBP_REQUIRE_VLLM=1) where vLLM is absent.
from vllm_harness import BS, first_step_of, prompt

from memory_node import memory_node  # noqa: F401  (the fixture)
from redis_server import redis  # noqa: F401  (the fixture)
from test_vllm import Harness, slot_bytes

HERE = Path(__file__).resolve().parent


# -- instances ----------------------------------------------------------------------------------


def harness(tmp, *, kv_role="kv_both", **extra):
    """test_vllm's harness (vLLM's scheduler, the workers, the fake forward pass) as a
    ``kv_role`` instance, its model's config in ``tmp`` (instances that share a pool serve one
    model: the same ``tmp``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return Harness(tmp, kv_role=kv_role, **extra)


def close(h):
    h.close()
    h.scheduler.connector.shutdown()


def summary(h):
    return {
        "stats": h.stats,
        "checked_loads": h.checked_loads,
        "load_errors": sorted(h.load_errors),
        "counters": asdict(h.index.counters),
        "node": h.index.node,
    }


def run_prompt(h, rid, tokens):
    """Runs one request to its end; returns (tokens computed before its first step: the
    connector's hit, tokens its first step computed)."""
    h.add(rid, tokens)
    so, computed = first_step_of(h, rid)
    h.run()
    return computed, so.num_scheduled_tokens.get(rid, 0)


CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {here!r})
    import test_vllm_pool as t
    args = json.loads({args!r})
    h = t.harness(Path(args["tmp"]), kv_role=args["role"], tp=args["tp"], **args["extra"])
    computed, _ = t.run_prompt(h, "a", args["tokens"])
    out = t.summary(h)
    out["computed"] = computed
    Path(args["out"] + ".tmp").write_text(json.dumps(out))
    Path(args["out"] + ".tmp").rename(args["out"])  # whole, or not there
    if args.get("crash"):
        os._exit(0)  # as a killed server: nothing closed, nothing flushed
    stop = Path(args["out"] + ".stop")
    deadline = time.monotonic() + 300
    while args.get("hold") and not stop.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t.close(h)
    """
)


class Child:
    """An instance in a process of its own: runs ``tokens`` as request "a" and reports;
    with ``hold``, stays up (its SSD file locked, its node announced) until stopped."""

    def __init__(self, tmp, tokens, *, role="kv_both", tp=1, hold=False, crash=False, **extra):
        self.out = tmp / "child.json"
        args = dict(
            tmp=str(tmp),
            role=role,
            tp=tp,
            extra=extra,
            tokens=tokens,
            out=str(self.out),
            hold=hold,
            crash=crash,
        )
        code = CHILD.format(here=str(HERE), args=json.dumps(args))
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(tmp))

    def result(self, timeout=300.0):
        deadline = time.monotonic() + timeout
        while not self.out.exists():
            rc = self.proc.poll()
            assert rc is None, f"the child instance exited with {rc}"
            assert time.monotonic() < deadline, "the child instance hung"
            time.sleep(0.05)
        return json.loads(self.out.read_text())

    def stop(self):
        Path(str(self.out) + ".stop").write_text("")
        try:
            rc = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert rc == 0, f"the child instance exited with {rc}"


class HeldSaves:
    """Wraps a worker's engine so that its save batches report done only after
    ``release()``: saves still in flight when the test acts."""

    class Batch:
        def __init__(self, owner, batch):
            self._owner, self._batch = owner, batch

        def done(self):
            return self._owner.released and self._batch.done()

        def __getattr__(self, name):
            return getattr(self._batch, name)

    def __init__(self, worker_side):
        self._engine = worker_side.engine
        self.released = False
        worker_side.engine = self

    def release(self):
        self.released = True

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def start_offload(self, objects, *args, **kwargs):
        return self.Batch(self, self._engine.start_offload(objects, *args, **kwargs))


def ssd(tmp, name, blocks=64):
    return dict(
        dram_bytes_per_rank=0,
        ssd_path=str(tmp / name),
        ssd_bytes_per_rank=blocks * slot_bytes(),
    )


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_instance_b_hits_and_loads_byte_exact_what_instance_a_saved_through_redis(
    tmp_path, redis, tp
):
    # Two instances, two processes, one Redis: A saves a prompt's blocks into its SSD file
    # and stays up (its file locked, its node announced); B finds them in one lookup, loads
    # them from A's file (opened read-only) and checks every byte against the prefix.
    shared = prompt(1, 10 * BS)
    a = Child(tmp_path, shared + [9], tp=tp, hold=True, pool=redis.url, **ssd(tmp_path, "a.ssd"))
    try:
        ra = a.result()
        assert ra["computed"] == 0 and ra["stats"].get("saved_blocks.ssd") == 10 * tp
        assert ra["counters"]["published"] == 10
        h = harness(tmp_path, tp=tp, pool=redis.url, **ssd(tmp_path, "b.ssd"))
        try:
            computed, scheduled = run_prompt(h, "b", shared + prompt(2, 21))
            assert computed == 10 * BS  # every block of A's, from the first
            assert scheduled == 21  # only the rest is computed
            assert h.checked_loads == 10 and not h.load_errors
            assert h.stats.get("loaded_blocks.ssd") == 10 * tp
            assert h.index.node != ra["node"]
            # B's own blocks (the rest of its prompt) went to its own file and are published.
            assert h.index.counters.published == 1
            assert h.index.counters.lookups >= 1 and h.index.counters.index_errors == 0
            assert h.index.pending_ops() == 0
        finally:
            close(h)
    finally:
        a.stop()


def test_a_restarted_instance_hits_its_own_ssd_tier_through_the_embedded_index(tmp_path):
    # The first instance saves and dies without closing anything (os._exit after its saves
    # were published); a new process with the same config hits every block and loads it
    # byte-exact. Without a pool the same restart is a miss (the in-process index is gone).
    cfg = ssd(tmp_path, "kv.ssd")
    shared = prompt(3, 8 * BS)
    first = Child(tmp_path, shared + [9], crash=True, pool="embedded", **cfg)
    r = first.result()
    assert first.proc.wait(timeout=60) == 0
    assert r["counters"]["published"] == 8
    assert (tmp_path / "kv.ssd.pool.redb").exists()  # beside the SSD tier
    h = harness(tmp_path, pool="embedded", **cfg)
    try:
        computed, _ = run_prompt(h, "b", shared + prompt(4, 30))
        assert computed == 8 * BS
        assert h.checked_loads == 8 and not h.load_errors
        assert h.stats.get("loaded_blocks.ssd") == 8
        assert h.index.node == r["node"]  # the same node: its SSD file is its identity
    finally:
        close(h)
    h = harness(tmp_path, **cfg)
    try:
        computed, _ = run_prompt(h, "c", shared + prompt(5, 30))
        assert computed == 0
    finally:
        close(h)


def test_a_producer_hands_a_prompts_kv_to_a_consumer_through_the_pool(tmp_path, redis):
    # Prefill/decode disaggregation: the producer (kv_producer) computes the prompt and saves
    # it, never loads; the consumer (kv_consumer) loads it, computes only the last token, and
    # saves nothing.
    p = prompt(6, 12 * BS)
    prod = Child(
        tmp_path, p + [9], role="kv_producer", hold=True, pool=redis.url, **ssd(tmp_path, "p.ssd")
    )
    try:
        rp = prod.result()
        assert rp["stats"].get("saved_blocks.ssd") == 12 and rp["counters"]["lookups"] == 0
        h = harness(tmp_path, kv_role="kv_consumer", pool=redis.url, **ssd(tmp_path, "c.ssd"))
        try:
            computed, scheduled = run_prompt(h, "d", p + [9])
            assert computed == 12 * BS and scheduled == 1
            assert h.checked_loads == 12 and not h.load_errors
            assert not h.stats.get("saved_blocks.ssd") and h.index.counters.saves["ssd"] == 0
        finally:
            close(h)
    finally:
        prod.stop()


def test_redis_killed_mid_run_lookups_miss_saves_fail_cleanly_and_all_resumes(tmp_path, redis):
    h = harness(tmp_path, pool=redis.url, pool_announce_s=0.6, **ssd(tmp_path, "kv.ssd"))
    try:
        p1, p2 = prompt(7, 6 * BS), prompt(8, 6 * BS)
        run_prompt(h, "a", p1 + [9])
        assert h.index.counters.published == 6
        # A request's saves are reserved in its first step; Redis dies before they land.
        held = HeldSaves(h.worker.worker_side)
        h.add("b", p2 + [9])
        first_step_of(h, "b")
        assert h.index.pending_ops() == 6
        redis.kill()
        held.release()
        h.run()
        c = h.index.counters
        assert c.published == 6 and c.failed_saves == 6 and c.index_errors > 0
        assert h.index.pending_ops() == 0  # nothing hangs on the lost server
        # Lookups miss (nothing wrong is loaded), saves fail, requests still complete.
        assert h.scheduler.reset_prefix_cache()
        computed, _ = run_prompt(h, "c", p1 + prompt(9, 20))
        assert computed == 0 and not h.load_errors
        # Redis comes back empty: the renewal announces the node again, and saves and hits
        # resume by themselves.
        redis.start()
        deadline = time.monotonic() + 60
        published = h.index.counters.published
        k = 0
        while h.index.counters.published < published + 6:
            assert time.monotonic() < deadline, "saves did not resume after Redis came back"
            assert h.scheduler.reset_prefix_cache()
            run_prompt(h, f"d{k}", p2 + [9])
            k += 1
            time.sleep(0.2)
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "e", p2 + prompt(10, 20))
        assert computed == 6 * BS and h.checked_loads - before == 6 and not h.load_errors
    finally:
        close(h)


class EvictBeforeLease:
    """A pool client whose first ``lease`` finds ``keys`` removed just before it (another
    instance evicted them between this instance's lookup and its lease)."""

    def __init__(self, client, keys):
        self._client, self._keys = client, keys

    def __getattr__(self, name):
        return getattr(self._client, name)

    def lease(self, placements, ttl):
        if self._keys:
            assert self._client.remove(self._keys) == ["removed"] * len(self._keys)
            self._keys = []
        return self._client.lease(placements, ttl)


def test_a_block_evicted_between_lookup_and_lease_is_a_load_error_vllm_recomputes(tmp_path):
    h = harness(tmp_path, pool="embedded", **ssd(tmp_path, "kv.ssd"))
    try:
        shared = prompt(11, 8 * BS)
        run_prompt(h, "a", shared + [9])
        assert h.index.counters.published == 8
        victim = 5
        keys = h.index.keys_of(h.requests["a"].block_hashes[victim])
        h.index.client = EvictBeforeLease(h.index.client, keys)
        assert h.scheduler.reset_prefix_cache()
        b = h.add("b", shared + prompt(12, 30))
        first_step_of(h, "b")  # scheduled once its load settled, failure included
        ids = h.block_ids("b")
        h.run()
        # The lookup counted 8 hits; the lease on the victim was refused: every rank reported
        # it failed (nothing read from its slot) and vLLM recomputed it and what follows.
        assert h.load_errors == {ids[victim]}
        assert h.index.counters.leases_refused == 1
        # The blocks around it loaded byte-exact (vLLM recomputes those after it anyway).
        assert h.checked_loads == 7 and h.prefills_checked == 2
        assert h.stats.get("load_errors.ssd") == 1
        # Recomputed and saved anew: a later request hits all eight, byte-exact.
        assert h.index.count_hits(b.block_hashes[:8]) == 8
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "c", shared + prompt(13, 20))
        assert computed == 8 * BS and h.checked_loads - before == 8
    finally:
        close(h)


def test_a_block_whose_bytes_changed_in_the_file_fails_its_checksum_and_leaves_the_pool(tmp_path):
    h = harness(tmp_path, pool="embedded", **ssd(tmp_path, "kv.ssd"))
    try:
        shared = prompt(14, 8 * BS)
        run_prompt(h, "a", shared + [9])
        victim = 3
        keys = h.index.keys_of(h.requests["a"].block_hashes[victim])
        [placement] = h.index.client.lookup(keys)
        at = placement.slot * slot_bytes() + 100
        with open(tmp_path / "kv.ssd", "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x01]))
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(15, 30))
        first_step_of(h, "b")  # scheduled once its load settled, failure included
        ids = h.block_ids("b")
        h.run()
        assert h.load_errors == {ids[victim]}
        assert h.stats.get("corrupt_blocks.ssd") == 1
        assert h.index.counters.failed_loads == 1
        # The corrupt copy left the pool; the recomputed block was published in its place.
        [again] = h.index.client.lookup(keys)
        assert again is not None and again.generation != placement.generation
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "c", shared + prompt(16, 20))
        assert computed == 8 * BS and h.checked_loads - before == 8
        assert h.stats.get("corrupt_blocks.ssd") == 1
    finally:
        close(h)


def test_blocks_computed_over_a_refused_layerwise_load_are_never_published(tmp_path):
    # Issue 34's rule under a pool: a layer-wise load feeds the step that computes the rest of
    # the prompt, so when one of its blocks fails (here its lease is refused), what that step
    # computed after it is wrong bytes. None of it may be published: a later request loads
    # every block and the harness checks each byte against what its prefix implies.
    h = harness(
        tmp_path, pool="embedded", load_mode="layerwise", layers_per_group=2,
        **ssd(tmp_path, "kv.ssd"),
    )
    try:
        shared = prompt(17, 8 * BS)
        run_prompt(h, "a", shared + [9])
        victim = 3
        keys = h.index.keys_of(h.requests["a"].block_hashes[victim])
        h.index.client = EvictBeforeLease(h.index.client, keys)
        assert h.scheduler.reset_prefix_cache()
        rest = prompt(18, 40)
        run_prompt(h, "b", shared + rest)
        assert len(h.load_errors) == 1 and h.index.counters.leases_refused == 1
        assert h.computed_wrong > 0  # the step did compute over the failed block
        assert h.index.counters.failed_saves >= 2  # b's blocks 8 and 9 of that step
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "c", shared + rest[: 2 * BS] + prompt(19, 5))
        assert computed == 10 * BS and h.checked_loads - before == 10
    finally:
        close(h)


# -- memory nodes -------------------------------------------------------------------------------


def reaches(node, redis, **extra):
    """An instance's keys to reach the pool's memory nodes (``node``'s secret, over TCP). A
    step waits for a connection as long as it takes (a live node on loopback answers at once,
    a killed one refuses at once), so what these tests count does not depend on the machine's
    speed; test_a_memory_node_whose_host_is_silent_never_stalls_a_step keeps the default."""
    return dict(
        pool=redis.url,
        remote_secret_file=str(node.secret_file),
        remote_transports="tcp",
        remote_connect_wait_s=600.0,
        **extra,
    )


def test_instance_b_hits_and_loads_byte_exact_what_instance_a_saved_into_a_memory_node(
    tmp_path, redis, memory_node
):
    # Two instances in two processes, one Redis, one umbp-ucx-serve memory node. A (TP 2) has
    # no tier of its own: every rank's shard of every block goes into the memory node, and A
    # exits (leaving the pool) before B starts, so nothing of A's process serves B. B saves
    # into its own SSD file, and finds A's blocks on the memory node in its one lookup, loads
    # them over the remote engine and checks every byte of both ranks against the prefix.
    node = memory_node(node_id=9001, slot_size=slot_bytes(), slots=64)
    shared = prompt(21, 10 * BS)
    a = Child(
        tmp_path,
        shared + [9],
        tp=2,
        **reaches(node, redis, pool_save_to="memory_nodes_only", dram_bytes_per_rank=0),
    )
    ra = a.result()
    a.stop()
    assert ra["computed"] == 0 and ra["stats"].get("saved_blocks.remote") == 10 * 2
    assert ra["counters"]["saves"]["remote"] == 10 and ra["counters"]["published"] == 10
    assert not ra["counters"]["no_room"] and not ra["stats"].get("save_errors.remote")
    # B reaches the node over one lane (A over the default two).
    h = harness(tmp_path, tp=2, **reaches(node, redis, remote_lanes=1, **ssd(tmp_path, "b.ssd")))
    try:
        computed, scheduled = run_prompt(h, "b", shared + prompt(22, 21))
        assert computed == 10 * BS  # every block of A's, from the memory node
        assert scheduled == 21
        assert h.checked_loads == 10 and not h.load_errors
        assert h.stats.get("loaded_blocks.remote") == 10 * 2
        assert h.index.counters.hits["remote"] == 10
        # B saves where it was told to (its own file, the default): its one new block.
        assert h.index.counters.saves["ssd"] == 1 and h.index.counters.saves["remote"] == 0
        assert h.index.counters.published == 1 and h.index.pending_ops() == 0
    finally:
        close(h)


def test_a_memory_node_whose_host_is_silent_never_stalls_a_step(tmp_path, redis):
    """Issue 42: a worker connected to a memory node inside the step, so a node whose host
    vanished (its connects hang until their timeout) stalled every step that touched it. The
    node here is announced in the pool at a host that accepts connections and never answers
    (as a frozen or firewalled host does): the steps that save to it end while the worker's
    connection to it still waits for the handshake's answer (the host still holds it open),
    those saves fail (counted, nothing published), and the instance goes on serving."""
    from umbp import _native

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    client = _native.PoolIndex(redis.url, timeout=2.0)
    client.register_tier(9011, 0, slot_bytes(), 64)
    client.announce(9011, f"127.0.0.1:{port}", [(0, 64 * slot_bytes())], 600.0)
    secret = tmp_path / "secret"
    secret.write_bytes(b"a silent host: a secret of 32 bytes or more\n")
    h = harness(
        tmp_path,
        pool=redis.url,
        remote_secret_file=str(secret),
        remote_transports="tcp",
        pool_save_to="memory_nodes_only",
        dram_bytes_per_rank=0,
    )
    try:
        shared = prompt(41, 4 * BS)
        run_prompt(h, "a", shared + [9])
        c = h.index.counters
        assert c.saves["remote"] == 4 and c.published == 0 and c.failed_saves == 4
        assert h.stats.get("save_errors.remote") == 4
        # The worker's connection reached the silent host and is still open, waiting: the
        # step did not wait for it.
        silent.settimeout(60.0)
        conn, _ = silent.accept()
        conn.setblocking(False)
        while True:  # what the worker sent (its hello), then: still open, or closed?
            try:
                sent = conn.recv(4096)
            except BlockingIOError:
                break  # open and waiting for the answer: the step did not wait for it
            assert sent != b"", "the worker's connect ended: the step waited for its timeout"
        # A second request's saves fail the same way, and the instance still computes and
        # serves: its prefills are checked by the harness.
        run_prompt(h, "b", prompt(42, 3 * BS) + [9])
        assert c.saves["remote"] == 7 and c.published == 0 and c.failed_saves == 7
        assert h.prefills_checked >= 2 and h.index.pending_ops() == 0
        conn.close()
    finally:
        close(h)
        silent.close()


class KillBeforeRestore:
    """Wraps a worker's engine: its next restore starts just after ``node`` was SIGKILLed,
    once the scheduler found the blocks and the pool granted their lease (the bytes are then
    asked of a node that is gone, through a connection made while it was up)."""

    def __init__(self, worker_side, node):
        self._engine = worker_side.engine
        self._node = node
        self.killed = False
        worker_side.engine = self

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def start_restore(self, objects, *args, **kwargs):
        if not self.killed:
            self._node.kill()
            self.killed = True
        return self._engine.start_restore(objects, *args, **kwargs)


def test_a_memory_node_killed_mid_get_fails_its_blocks_which_vllm_recomputes(
    tmp_path, redis, memory_node
):
    node = memory_node(node_id=9002, slot_size=slot_bytes(), slots=64, ttl_ms=1000)
    h = harness(
        tmp_path, **reaches(node, redis, pool_save_to="memory_nodes", **ssd(tmp_path, "kv.ssd"))
    )
    try:
        shared = prompt(23, 8 * BS)
        run_prompt(h, "a", shared + [9])
        c = h.index.counters
        assert c.saves["remote"] == 8 and c.published == 8 and c.saves["ssd"] == 0
        assert h.stats.get("saved_blocks.remote") == 8
        # A second request hits all 8 on the memory node; the node is SIGKILLed between the
        # lease and the transfer. Every one of its blocks is a load error (nothing loaded,
        # nothing wrong), vLLM recomputes them, and the harness checks the recomputed prefill.
        kill = KillBeforeRestore(h.worker.worker_side, node)
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(24, 30))
        _, computed = first_step_of(h, "b")
        ids = h.block_ids("b")
        h.run()
        assert kill.killed and computed == 0
        assert h.load_errors == set(ids[:8])
        assert h.stats.get("load_errors.remote") == 8 and not h.stats.get("loaded_blocks.remote")
        assert c.hits["remote"] == 8 and c.failed_loads == 8
        assert h.prefills_checked >= 1 and h.index.pending_ops() == 0
        # Once the dead node's announcement lapsed, saves fall back to this instance's SSD
        # tier (each counted), are published, and a later request hits them byte-exact.
        deadline = time.monotonic() + 30
        while any(n == node.node_id for n, _, _ in h.index.client.nodes()):
            assert time.monotonic() < deadline, "the killed node's announcement never lapsed"
            time.sleep(0.1)
        time.sleep(1.1)  # the index's view of the nodes is at most a second old
        fell, published, ssd_saves = c.fell_back, c.published, c.saves["ssd"]
        other = prompt(25, 6 * BS)
        run_prompt(h, "c", other + [9])
        assert c.fell_back - fell == 6 and c.saves["ssd"] - ssd_saves == 6
        assert c.published - published == 6
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "d", other + prompt(26, 20))
        assert computed == 6 * BS and h.checked_loads - before == 6
        assert h.stats.get("loaded_blocks.ssd") == 6
        # The node restarts at its address (empty): saves go to it again, through a new
        # connection (the one to its old life was dropped when the loads through it failed),
        # and a later request loads them from it byte-exact.
        node.restart()
        while not any(n == node.node_id for n, _, _ in h.index.client.nodes()):
            assert time.monotonic() < deadline + 30, "the restarted node never joined"
            time.sleep(0.1)
        time.sleep(1.1)
        remote, errors = c.saves["remote"], h.stats.get("save_errors.remote", 0)
        again = prompt(27, 5 * BS)
        run_prompt(h, "e", again + [9])
        assert c.saves["remote"] - remote == 5 and h.stats.get("save_errors.remote") == errors
        assert h.scheduler.reset_prefix_cache()
        before, loaded = h.checked_loads, h.stats.get("loaded_blocks.remote", 0)
        computed, _ = run_prompt(h, "f", again + prompt(28, 20))
        assert computed == 5 * BS and h.checked_loads - before == 5
        assert h.stats.get("loaded_blocks.remote", 0) - loaded == 5
        # Restarted again while the instance is idle (nothing failed through the old
        # connection): the worker sees that connection ended and connects anew before its
        # next saves, so none of them fails.
        node.restart()
        deadline = time.monotonic() + 30
        while not any(n == node.node_id for n, _, _ in h.index.client.nodes()):
            assert time.monotonic() < deadline, "the restarted node never joined"
            time.sleep(0.1)
        time.sleep(1.1)
        remote, errors = c.saves["remote"], h.stats.get("save_errors.remote", 0)
        third = prompt(29, 4 * BS)
        run_prompt(h, "g", third + [9])
        assert c.saves["remote"] - remote == 4 and h.stats.get("save_errors.remote") == errors
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "i", third + prompt(30, 20))
        assert computed == 4 * BS and h.checked_loads - before == 4
    finally:
        close(h)


def test_a_block_whose_bytes_changed_on_the_memory_node_fails_its_checksum_and_leaves_the_pool(
    tmp_path, redis, memory_node
):
    import umbp
    from memory_node import SECRET

    node = memory_node(node_id=9003, slot_size=slot_bytes(), slots=64)
    h = harness(
        tmp_path,
        **reaches(node, redis, pool_save_to="memory_nodes_only", dram_bytes_per_rank=0),
    )
    try:
        shared = prompt(31, 8 * BS)
        run_prompt(h, "a", shared + [9])
        assert h.index.counters.published == 8
        victim = 3
        keys = h.index.keys_of(h.requests["a"].block_hashes[victim])
        [placement] = h.index.client.lookup(keys)
        assert placement.node == node.node_id
        # Another client of the node flips one bit of the block where it lies.
        other = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET)
        peer = other.connect(node.address)
        with other.register_remote(peer.region("kv")) as kv:
            at = placement.slot * slot_bytes() + 100
            byte = other.read(kv, at, 1)
            other.write(kv, at, bytes([byte[0] ^ 0x01]))
        other.disconnect(peer)
        assert h.scheduler.reset_prefix_cache()
        h.add("b", shared + prompt(32, 30))
        first_step_of(h, "b")  # scheduled once its load settled, failure included
        ids = h.block_ids("b")
        h.run()
        assert h.load_errors == {ids[victim]}
        assert h.stats.get("corrupt_blocks.remote") == 1 and h.stats.get("load_errors.remote") == 1
        assert h.index.counters.failed_loads == 1
        # The corrupt copy left the pool; the recomputed block was saved to the node anew.
        [again] = h.index.client.lookup(keys)
        assert again is not None and again.generation != placement.generation
        assert h.scheduler.reset_prefix_cache()
        before = h.checked_loads
        computed, _ = run_prompt(h, "c", shared + prompt(33, 20))
        assert computed == 8 * BS and h.checked_loads - before == 8
        assert h.stats.get("corrupt_blocks.remote") == 1
    finally:
        close(h)


def test_memory_nodes_need_a_redis_pool_and_their_secret(tmp_path, monkeypatch):
    from umbp.vllm import UmbpConfig

    monkeypatch.delenv("UMBP_UCX_SECRET", raising=False)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 32 + b"\n")
    with pytest.raises(ValueError, match="pool_save_to must be one of"):
        UmbpConfig.from_extra({"pool": "redis://h:1/", "pool_save_to": "nodes"})
    with pytest.raises(ValueError, match="needs the memory nodes' shared secret"):
        UmbpConfig.from_extra({"pool": "redis://h:1/", "pool_save_to": "memory_nodes"})
    with pytest.raises(ValueError, match="join a Redis pool"):
        UmbpConfig.from_extra(
            {"pool": "embedded", "ssd_path": "/x", "ssd_bytes_per_rank": 1 << 20,
             "pool_save_to": "memory_nodes", "remote_secret_file": str(secret)}
        )
    for lanes in (0, 65, True, 1.5):
        with pytest.raises(ValueError, match="remote_lanes must be an integer from 1 to 64"):
            UmbpConfig.from_extra({"pool": "redis://h:1/", "remote_lanes": lanes})
    cfg = UmbpConfig.from_extra(
        {"pool": "redis://h:1/", "pool_save_to": "memory_nodes_only",
         "remote_secret_file": str(secret)}
    )
    assert cfg.memory_nodes() and cfg.remote_secret() == b"x" * 32
    assert cfg.remote_options()["remote_lanes"] == 2
    three = UmbpConfig.from_extra(
        {"pool": "redis://h:1/", "remote_secret_file": str(secret), "remote_lanes": 3}
    )
    assert three.remote_options()["remote_lanes"] == 3
    assert cfg.remote_options()["remote_congestion"] == "auto"
    reno = UmbpConfig.from_extra(
        {"pool": "redis://h:1/", "remote_secret_file": str(secret), "remote_congestion": "reno"}
    )
    assert reno.remote_options()["remote_congestion"] == "reno"
    for bad in ("", 3, None):
        with pytest.raises(ValueError, match="remote_congestion must be"):
            UmbpConfig.from_extra({"pool": "redis://h:1/", "remote_congestion": bad})
    # Without the secret, memory nodes' blocks are not this instance's hits.
    assert not UmbpConfig.from_extra({"pool": "redis://h:1/"}).memory_nodes()
    monkeypatch.setenv("UMBP_UCX_SECRET", "y" * 32)
    assert UmbpConfig.from_extra({"pool": "redis://h:1/"}).memory_nodes()
