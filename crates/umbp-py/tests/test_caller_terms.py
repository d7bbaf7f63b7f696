"""Errors and metrics in the caller's terms: a region is named in error messages by the label
given at registration, a file by its path; ``Engine.metrics()`` uses the Prometheus counters'
names."""

import os
import re

import numpy as np
import pytest

import umbp

PAGE = 16 << 10


def test_errors_name_a_labelled_region_and_a_file_by_what_the_caller_gave():
    engine = umbp.Engine()
    tier_bytes = np.zeros(4 * PAGE, dtype=np.uint8)
    dst = np.zeros(2 * PAGE, dtype=np.uint8)
    with engine.register(tier_bytes, label="dram-tier") as tier, engine.register(
        dst, label="kv-cache"
    ) as kv:
        assert tier.label == "dram-tier" and kv.label == "kv-cache"
        past_end = umbp.Object(7, tier, [0], PAGE, PAGE, [umbp.Range(0, PAGE, kv, 2 * PAGE - 10)])
        report = engine.restore([past_end])
        error = report.object(7).error
        assert isinstance(error, umbp.RejectedError)
        assert '"kv-cache"' in error.reason and '"kv-cache"' in str(error), str(error)
        assert "endpoint " not in str(error), str(error)
    assert kv.label is None  # closed


def test_a_file_is_named_by_its_path_unless_labelled(tmp_path):
    engine = umbp.Engine()
    path = tmp_path / "tier.bin"
    path.write_bytes(bytes(2 * PAGE))
    dst = np.zeros(4 * PAGE, dtype=np.uint8)
    with engine.register_file(path, direct=False) as f, engine.register(dst) as d:
        assert f.label == str(path)
        past_end = umbp.Object(9, f, [2 * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, d, 0)])
        error = engine.restore([past_end]).object(9).error
        assert f'"{path}"' in str(error), str(error)
    with engine.register_file(path, direct=False, label="ssd-tier") as f:
        assert f.label == "ssd-tier"


def test_metrics_use_the_prometheus_counters_names():
    engine = umbp.Engine()
    src = np.arange(2 * PAGE, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros(2 * PAGE, dtype=np.uint8)
    with engine.register(src) as s, engine.register(dst) as d:
        ok = umbp.Object(1, s, [0, PAGE], PAGE, 2 * PAGE, [umbp.Range(0, 2 * PAGE, d, 0)])
        bad = umbp.Object(2, s, [0], PAGE, PAGE, [umbp.Range(0, PAGE, d, 2 * PAGE - 1)])
        engine.restore([ok, bad])
    metrics = engine.metrics()
    text = engine.metrics_text()
    # Each key of a counter set is a Prometheus counter: umbp_transfer_<key>_total, or
    # umbp_<key>_total for rejected_objects; their sums over the extra labels agree.
    for (name, direction), counters in metrics["engines"].items():
        for key, value in counters.items():
            metric = f"umbp_{key}_total" if key == "rejected_objects" else f"umbp_transfer_{key}_total"
            lines = [
                line
                for line in text.splitlines()
                if line.startswith(metric + "{")
                and f'engine="{name}"' in line
                and f'direction="{direction}"' in line
            ]
            total = sum(int(float(line.rsplit(" ", 1)[1])) for line in lines)
            assert total == value, (key, metric, lines, value)
    assert set(next(iter(metrics["engines"].values()))) == {
        "segments",
        "bytes",
        "objects",
        "failures",
        "rejected_objects",
    }
    assert any(c["rejected_objects"] == 1 for c in metrics["engines"].values()), metrics
    for key in ("batches", "bytes"):
        assert re.search(rf"^umbp_in_flight_{key} 0$", text, re.M), text


SECRET = b"umbp python tests: 32 bytes long"


def test_a_remote_region_is_named_by_its_name_on_the_node():
    try:
        engine = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET)
    except umbp.Error as e:
        if os.environ.get("UMBP_REQUIRE_UCX") == "1":
            raise
        pytest.skip(f"no remote tier here: {e}")
    arena = np.zeros(4 * PAGE, dtype=np.uint8)
    server = umbp.Server({"arena": arena}, transports="tcp", secret=SECRET)
    peer = engine.connect(server.address)
    out = np.zeros(2 * PAGE, dtype=np.uint8)
    with engine.register_remote(peer.region("arena")) as remote, engine.register(out) as dst:
        assert remote.label == "arena"
        past_end = umbp.Object(5, remote, [4 * PAGE], PAGE, PAGE, [umbp.Range(0, PAGE, dst, 0)])
        error = engine.restore([past_end]).object(5).error
        assert '"arena"' in str(error), str(error)
    with engine.register_remote(peer.region("arena"), label="node-a") as remote:
        assert remote.label == "node-a"
    server.close()
