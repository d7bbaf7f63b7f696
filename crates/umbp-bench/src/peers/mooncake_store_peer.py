"""Mooncake Store as a peer of `umbp-bench pool` (see peers/mooncake_store.rs).

Run with the python of scripts/mooncake-venv (PyPI `mooncake-transfer-engine-non-cuda`, which
ships `mooncake.store` and `mooncake_master`), beside a `mooncake_master` on loopback, in one of
two roles; each speaks JSON lines: commands on stdin, one answer per command on stdout
(Mooncake's own log goes to stderr).

    python mooncake_store_peer.py holder MASTER METADATA BYTES
        A store client that mounts BYTES bytes of memory into the store (its global segment)
        and holds nothing else: the memory node. Answers {"ready": true}, then serves until
        stdin closes.

    python mooncake_store_peer.py client MASTER METADATA BYTES
        A store client that mounts no memory of its own (so every object lands in the
        holder's) with a registered buffer of BYTES bytes. Answers {"ready": true}; then per
        command line:
          {"op": "fill", "n": N}      puts N objects of 16 bytes under the lookup keys 0..N
                                      (put_batch, 1,000 per call); answers {"stored": n}
          {"op": "exist", "n": N}     one timed batch_is_exist of keys 0..N; answers
                                      {"seconds": s, "found": f}
          {"op": "put", "round": R, "size": S, "n": N}
                                      one timed batch_put_from of N objects of S bytes from the
                                      buffer (object i at offset i*S holds a pattern of (R, i))
                                      under keys of round R; answers {"seconds": s, "ok": n}
          {"op": "get", "round": R, "size": S, "n": N}
                                      poisons the buffer, one timed batch_get_into of round R's
                                      objects, then checks every byte; answers
                                      {"seconds": s, "ok": n, "verified": b}
          {"op": "remove", "round": R, "n": N}
                                      removes round R's objects (untimed; forced, past
                                      the lease a get takes); answers {"removed": n}
        A failure answers {"error": "why"} and the program exits.

MASTER is host:port of the master's RPC, METADATA the URL of its HTTP metadata server.
Lookup keys are 32 hex digits, as long as umbp's 16-byte keys printed.
"""

import ctypes
import json
import mmap
import struct
import sys
import time


def fail(why):
    print(json.dumps({"error": why}), flush=True)
    sys.exit(1)


def answer(obj):
    print(json.dumps(obj), flush=True)


def store(master, metadata, segment, buffer):
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        fail(f"mooncake.store does not import: {e}")
    s = MooncakeDistributedStore()
    ret = s.setup("127.0.0.1", metadata, segment, buffer, "tcp", "", master)
    if ret != 0:
        fail(f"MooncakeDistributedStore.setup(tcp, master {master}) returned {ret}")
    return s


def lookup_key(i):
    return f"{i:032x}"


def object_key(r, i):
    return f"r{r}-{i:08x}"


def pattern(r, i, size):
    return struct.pack("<QQ", r, i) * (size // 16)


def holder(master, metadata, size):
    s = store(master, metadata, size, 16 << 20)
    answer({"ready": True})
    for _ in sys.stdin:
        pass
    s.close()


def client(master, metadata, size):
    s = store(master, metadata, 0, 16 << 20)
    mem = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    if s.register_buffer(addr, size) != 0:
        fail(f"register_buffer of {size} bytes failed")
    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        n = cmd.get("n", 0)
        if op == "fill":
            stored = 0
            for start in range(0, n, 1000):
                keys = [lookup_key(i) for i in range(start, min(n, start + 1000))]
                ret = s.put_batch(keys, [b"\x5a" * 16] * len(keys))
                if ret != 0:
                    fail(f"put_batch of {len(keys)} lookup keys returned {ret}")
                stored += len(keys)
            answer({"stored": stored})
        elif op == "exist":
            keys = [lookup_key(i) for i in range(n)]
            start = time.perf_counter()
            found = s.batch_is_exist(keys)
            seconds = time.perf_counter() - start
            answer({"seconds": seconds, "found": sum(1 for f in found if f == 1)})
        elif op in ("put", "get"):
            r, size = cmd["round"], cmd["size"]
            if n * size > len(mem) or size % 16:
                fail(f"{n} objects of {size} bytes do not fit the {len(mem)}-byte buffer")
            keys = [object_key(r, i) for i in range(n)]
            ptrs = [addr + i * size for i in range(n)]
            sizes = [size] * n
            if op == "put":
                for i in range(n):
                    mem[i * size:(i + 1) * size] = pattern(r, i, size)
                start = time.perf_counter()
                res = s.batch_put_from(keys, ptrs, sizes)
                seconds = time.perf_counter() - start
                answer({"seconds": seconds, "ok": sum(1 for x in res if x == 0)})
            else:
                poison = b"\xa5" * size
                for i in range(n):
                    mem[i * size:(i + 1) * size] = poison
                start = time.perf_counter()
                res = s.batch_get_into(keys, ptrs, sizes)
                seconds = time.perf_counter() - start
                ok = sum(1 for x in res if x == size)
                verified = all(mem[i * size:(i + 1) * size] == pattern(r, i, size) for i in range(n))
                answer({"seconds": seconds, "ok": ok, "verified": verified})
        elif op == "remove":
            keys = [object_key(cmd["round"], i) for i in range(n)]
            removed = sum(1 for x in s.batch_remove(keys, True) if x == 0)
            answer({"removed": removed})
        else:
            fail(f"unknown command {line.strip()!r}")
    s.close()


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("holder", "client"):
        fail("usage: mooncake_store_peer.py holder|client MASTER METADATA BYTES")
    size = int(sys.argv[4])
    if size <= 0:
        fail(f"BYTES must be positive, not {size}")
    (holder if sys.argv[1] == "holder" else client)(sys.argv[2], sys.argv[3], size)


if __name__ == "__main__":
    main()
