"""The engine's Prometheus metrics, read as a scraper reads them, after a restore."""

import numpy as np

import umbp

PAGE = 16 << 10


def sample(text, name, **labels):
    """The value of the sample `name{labels}` (other labels ignored), or None."""
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        metric, _, rest = series.partition("{")
        if metric == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    return None


def test_metrics_text_counts_a_restore():
    engine = umbp.Engine()
    tier = ((np.arange(8 * PAGE, dtype=np.uint64) * 2654435761) >> 7).astype(np.uint8)
    out = np.zeros(4 * PAGE, dtype=np.uint8)
    with engine.register(tier) as t, engine.register(out) as d:
        objects = [
            umbp.Object(tag, t, [(7 - 2 * tag) * PAGE, (6 - 2 * tag) * PAGE], PAGE, 2 * PAGE,
                        [umbp.Range(0, 2 * PAGE, d, 2 * tag * PAGE)])
            for tag in range(2)
        ]
        engine.restore(objects).raise_for_errors()
        assert bytes(out[:PAGE]) == bytes(tier[7 * PAGE:8 * PAGE])
        assert bytes(out[3 * PAGE:]) == bytes(tier[4 * PAGE:5 * PAGE])
        text = engine.metrics_text()
        # Reading bytes back is a probe, not traffic: it counts nowhere.
        assert engine.read(d, 0, PAGE) == bytes(tier[7 * PAGE:8 * PAGE])
        assert engine.metrics_text() == text
    assert text.endswith("# EOF\n")
    assert sample(text, "umbp_transfer_bytes_total", direction="host->host") == 4 * PAGE
    assert sample(text, "umbp_transfer_objects_total", direction="host->host") == 2
    assert sample(text, "umbp_objects_total", outcome="completed") == 2
    assert sample(text, "umbp_batch_duration_seconds_count") == 1
    assert sample(text, "umbp_object_duration_seconds_count") == 2
    assert sample(text, "umbp_in_flight_batches") == 0
