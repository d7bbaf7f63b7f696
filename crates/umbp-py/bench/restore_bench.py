"""The Kimi-K3-shaped restore driven from Python against the same restore driven from Rust.

Both restore the same objects (24 ranges of 1 MiB, 64 KiB pages laid out by the same seeded
scatter as `umbp-bench restore`, contiguity 0.1) from a DRAM tier into one simulated-device
buffer per range, through the same engines (host copies, the device engine, the SSD engine,
one composite). The Rust figure is the `dram` row (one caller, incremental builders) of
`umbp-bench restore --json --no-fio`; the Python figure is `umbp.Engine.restore` over the same
layout, every range in one layer group as there (the simulated device copies a launch of 32 MiB
or more with streaming stores and a smaller one with `memcpy`, so a restore in 24 groups of
16 MiB is a different copy: it read 0.59–0.63 of the Rust row, one group 0.98–1.04).
The two alternate, twice each; each side reports the median of its runs' medians. Target:
Python at least 0.9x Rust (the binding adds per-batch cost, not per-fragment cost).

    python crates/umbp-py/bench/restore_bench.py [--bench target/release/umbp-bench] [--scale 16]

Prints one JSON line: rust_gib_s, python_gib_s, ratio, the runs' largest spread, and a verdict:
"met" when the ratio clears 0.9 by more than the spread, "unmet" when it misses by more,
"within noise" otherwise.
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np

import umbp

MASK = (1 << 64) - 1


class SplitMix:
    """splitmix64, as the Rust bench's `SplitMix`: the same seed gives the same layout."""

    def __init__(self, seed):
        self.state = seed

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def unit(self):
        return (self.next() >> 11) / float(1 << 53)

    def below(self, n):
        return self.next() % n


def scatter(objects, pages_per_object, page_size, contiguity, seed):
    """`PageTable::scatter` of the Rust bench: each object's page list (byte offsets)."""
    rng = SplitMix(seed)
    runs = []
    for o in range(objects):
        start = o * pages_per_object
        for k in range(1, pages_per_object + 1):
            if k == pages_per_object or rng.unit() >= contiguity:
                runs.append((start, o * pages_per_object + k - start))
                start = o * pages_per_object + k
    for i in range(len(runs) - 1, 0, -1):
        j = rng.below(i + 1)
        runs[i], runs[j] = runs[j], runs[i]
    pages = np.zeros(objects * pages_per_object, dtype=np.uint64)
    next_free = 0
    for start, length in runs:
        pages[start:start + length] = (np.arange(length, dtype=np.uint64) + next_free) * page_size
        next_free += length
    return pages.reshape(objects, pages_per_object)


def rust_run(bench, scale, iterations):
    out = subprocess.run(
        [bench, "--json", "restore", "--scale", str(scale), "--callers", "1", "--ssd-fraction", "0.5",
         "--iterations", str(iterations), "--no-fio"],
        check=True, capture_output=True, text=True,
    ).stdout
    for line in out.splitlines():
        row = json.loads(line)
        if row.get("source") == "dram" and row.get("builder") == "incremental" and row.get("callers") == 1:
            assert row["verified"], row
            return row["gib_s"], row["spread"]
    raise RuntimeError("no dram row in umbp-bench restore's output")


def python_run(engine, tier, destinations, table, ranges, range_len, page_size, iterations):
    objects_n = table.shape[0]
    size = ranges * range_len
    objects = [
        umbp.Object(o, tier, table[o], page_size, size,
                    [umbp.Range(r * range_len, range_len, destinations[r], o * range_len) for r in range(ranges)])
        for o in range(objects_n)
    ]
    times = []
    engine.restore(objects).raise_for_errors()  # warm-up
    for _ in range(iterations):
        t = time.perf_counter()
        report = engine.restore(objects)  # the objects' description, planning, submit, wait
        times.append(time.perf_counter() - t)
        report.raise_for_errors()
    times.sort()
    median = times[len(times) // 2]
    gib_s = objects_n * size / median / (1 << 30)
    return gib_s, (times[-1] - times[0]) / median


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_bench = os.path.join(here, "..", "..", "..", "target", "release", "umbp-bench")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench", default=default_bench, help="the umbp-bench binary")
    p.add_argument("--scale", type=int, default=16, help="objects of 24 MiB")
    p.add_argument("--iterations", type=int, default=3)
    args = p.parse_args()

    ranges, range_len, page_size = 24, 1 << 20, 64 << 10
    pages_per_object = ranges * range_len // page_size
    table = scatter(args.scale, pages_per_object, page_size, 0.1, 7)
    engine = umbp.Engine()
    arena = np.zeros(args.scale * pages_per_object * page_size, dtype=np.uint8)
    arena[::4096] = 1
    tier = engine.register(arena)
    destinations = [engine.alloc_device(args.scale * range_len) for _ in range(ranges)]

    rust, python = [], []
    for _ in range(2):  # alternate, so drift on a shared machine hits both alike
        rust.append(rust_run(args.bench, args.scale, args.iterations))
        python.append(python_run(engine, tier, destinations, table, ranges, range_len, page_size, args.iterations))
    rust_gib_s = statistics.median(r[0] for r in rust)
    python_gib_s = statistics.median(r[0] for r in python)
    noise = max(r[1] for r in rust + python)
    ratio = python_gib_s / rust_gib_s
    # Met only if the ratio clears the target by more than the runs' spread.
    if ratio - noise >= 0.9:
        verdict = "met"
    elif ratio + noise < 0.9:
        verdict = "unmet"
    else:
        verdict = "within noise"
    print(json.dumps({
        "objects": args.scale, "fragments": args.scale * ranges * (range_len // page_size),
        "rust_gib_s": round(rust_gib_s, 3), "python_gib_s": round(python_gib_s, 3),
        "ratio": round(ratio, 3), "spread": round(noise, 3), "target": 0.9, "verdict": verdict,
    }))


if __name__ == "__main__":
    main()
