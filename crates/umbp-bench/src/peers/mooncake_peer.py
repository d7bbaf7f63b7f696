"""Mooncake Transfer Engine as a peer of `umbp-bench remote` (see peers/mooncake.rs).

Run with the python of scripts/mooncake-venv (PyPI `mooncake-transfer-engine-non-cuda`), in one
of two roles; each speaks JSON lines: commands on stdin, one answer per command on stdout
(Mooncake's own log goes to stderr).

    python mooncake_peer.py target BYTES
        Starts a transfer engine (TCP transport, P2P handshake, loopback) exporting BYTES bytes
        filled with a pattern (every 8-byte word of 4 KiB block k is k), answers
        {"segment": "127.0.0.1:PORT", "base": ADDRESS}, then serves until stdin closes.

    python mooncake_peer.py initiator BYTES
        Starts a transfer engine with a destination of BYTES bytes and answers {"ready": true};
        then per command line:
          {"op": "setup", "segment": S, "base": B, "size": N, "src": [...], "dst": [...]}
              the next reads: one fragment of N bytes from each arena offset src[i] of the
              target's buffer at B to destination offset dst[i]; answers {"fragments": n}
          {"op": "run"}     one timed batch_transfer_sync_read of every fragment;
                            answers {"seconds": s, "gib_s": g}
          {"op": "verify"}  poisons the destination, reads once more and checks every byte
                            against the pattern; answers {"verified": true/false}
          {"op": "singles", "src": [...], "dst": [...]}
              one transfer_sync_read of 4 KiB per pair, one at a time, each timed alone and
              checked after (its slot poisoned before); answers {"us": [...], "verified": b}
        A failure answers {"error": "why"} and the program exits.
"""

import ctypes
import json
import mmap
import struct
import sys
import time

BLOCK = 4096


def fail(why):
    print(json.dumps({"error": why}), flush=True)
    sys.exit(1)


def answer(obj):
    print(json.dumps(obj), flush=True)


def engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        fail(f"mooncake.engine does not import: {e}")
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        fail("TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) failed")
    return te


def buffer(te, size):
    """An anonymous mapping of `size` bytes registered with `te`: (mmap, address)."""
    mem = mmap.mmap(-1, size)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    if te.register_memory(addr, size) != 0:
        fail(f"register_memory of {size} bytes failed")
    return mem, addr


def block(k):
    return struct.pack("<Q", k) * (BLOCK // 8)


def target(size):
    te = engine()
    mem, addr = buffer(te, size)
    for k in range(size // BLOCK):
        mem[k * BLOCK:(k + 1) * BLOCK] = block(k)
    answer({"segment": f"127.0.0.1:{te.get_rpc_port()}", "base": addr})
    for _ in sys.stdin:
        pass


def initiator(size):
    te = engine()
    mem, addr = buffer(te, size)
    answer({"ready": True})
    job = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "setup":
            n, base = cmd["size"], cmd["base"]
            src, dst = cmd["src"], cmd["dst"]
            if len(src) != len(dst) or n % BLOCK or any(d + n > size for d in dst):
                fail("a setup whose fragments do not fit the destination")
            job = (cmd["segment"], [addr + d for d in dst], [base + s for s in src], [n] * len(src),
                   n, src, dst, base)
            answer({"fragments": len(src)})
        elif op == "singles" and job is not None:
            segment, base = job[0], job[7]
            times, ok = [], True
            for s, d in zip(cmd["src"], cmd["dst"]):
                if d + BLOCK > size:
                    fail("a single transfer past the destination")
                mem[d:d + BLOCK] = b"\xa5" * BLOCK
                start = time.perf_counter()
                ret = te.transfer_sync_read(segment, addr + d, base + s, BLOCK)
                times.append((time.perf_counter() - start) * 1e6)
                if ret != 0:
                    fail(f"transfer_sync_read of {BLOCK} bytes returned {ret}")
                ok = ok and mem[d:d + BLOCK] == block(s // BLOCK)
            answer({"us": times, "verified": ok})
        elif op in ("run", "verify") and job is not None:
            segment, local, remote, lengths, n, src, dst, _ = job
            if op == "verify":
                mem[:] = b"\xa5" * size
            start = time.perf_counter()
            ret = te.batch_transfer_sync_read(segment, local, remote, lengths)
            seconds = time.perf_counter() - start
            if ret != 0:
                fail(f"batch_transfer_sync_read of {len(local)} fragments returned {ret}")
            if op == "run":
                answer({"seconds": seconds, "gib_s": n * len(local) / seconds / (1 << 30)})
            else:
                ok = all(
                    mem[d + j:d + j + BLOCK] == block((s + j) // BLOCK)
                    for s, d in zip(src, dst)
                    for j in range(0, n, BLOCK)
                )
                answer({"verified": ok})
        else:
            fail(f"unknown or early command {line.strip()!r}")


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("target", "initiator"):
        fail("usage: mooncake_peer.py target|initiator BYTES")
    size = int(sys.argv[2])
    if size <= 0 or size % BLOCK:
        fail(f"BYTES must be a positive multiple of {BLOCK}, not {size}")
    (target if sys.argv[1] == "target" else initiator)(size)


if __name__ == "__main__":
    main()
