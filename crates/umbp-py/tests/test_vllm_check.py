"""``python -m umbp.vllm.check CONFIG.json``, run as a user runs it: a subprocess, its printed
numbers and its exit status.

Its toy model's block is 4 layers of 16 tokens x 2 KV heads x 16 x K and V in fp16: 8 KiB.
Each pass sends ``--requests`` prompts of ``--prefix-blocks`` shared blocks, 2 blocks and 3
tokens of their own; the first pass saves the shared blocks once and each prompt's own 2, the
second must hit exactly the shared blocks of each prompt.

Needs vLLM (`bash .ci/vllm-venv`); skipped with the reason printed where it is absent, and a
failure where UMBP_REQUIRE_VLLM=1.
"""

import json
import os
import subprocess
import sys

import pytest

# First: it skips this module (or fails, with UMBP_REQUIRE_VLLM=1) where vLLM is absent.
import vllm_harness  # noqa: F401

BLOCK = 4 * 16 * 2 * 16 * 2 * 2  # layers x tokens x KV heads x head x (K, V) x fp16


def check(tmp_path, config, *args):
    """Runs the command on ``config`` (written as CONFIG.json) with its SSD files under
    ``tmp_path``; returns (exit status, stdout, stderr, the JSON result or None)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-m", "umbp.vllm.check", str(path), "--json", "--ssd-dir", str(scratch)]
        + list(args),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    # The check's temporary directory (SSD files, an embedded pool) is gone afterwards.
    assert os.listdir(scratch) == []
    return out.returncode, out.stdout, out.stderr, json.loads(lines[-1]) if lines else None


def test_an_extra_config_saves_the_prefix_once_and_the_second_pass_hits_exactly_it(tmp_path):
    # A server's configuration: 64 GiB of DRAM and a 1 TiB SSD file per rank on a path that
    # does not exist here. The tiers are capped and the file made in a temporary directory.
    config = {
        "dram_bytes_per_rank": 64 << 30,
        "ssd_path": "/nonexistent/umbp/kv-{rank}",
        "ssd_bytes_per_rank": 1 << 40,
        "layers_per_group": 2,
        "load_mode": "layerwise",
    }
    status, stdout, stderr, r = check(tmp_path, config)
    assert status == 0, stdout + stderr
    assert r["form"] == "kv_connector_extra_config" and r["load_mode"] == "layerwise"
    # 8 shared blocks saved once, 2 of each of the 4 prompts' own: all in DRAM.
    assert r["saved_blocks"] == {"dram": 8 + 4 * 2}
    assert r["expected_hit_blocks"] == r["hit_blocks"] == r["verified_blocks"] == 4 * 8
    assert r["hit_tokens"] == 4 * 8 * 16
    assert r["loaded_blocks"] == {"dram": 32}
    assert r["block_bytes"] == BLOCK and r["verified_bytes"] == 32 * BLOCK
    assert r["load_errors"] == 0 and r["ok"] is True
    assert "hit 32 of 32 shared blocks (512 of 512 tokens)" in stdout
    assert f"verified: 32 blocks, {32 * BLOCK} bytes" in stdout
    assert "dram_bytes_per_rank 68719476736 capped at 67108864" in stdout
    assert not os.path.exists("/nonexistent/umbp")


def test_a_whole_kv_transfer_config_with_an_ssd_tier_and_an_embedded_pool(tmp_path):
    config = {
        "kv_connector": "UmbpConnector",
        "kv_connector_module_path": "umbp.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "dram_bytes_per_rank": 0,
            "ssd_path": "/nvme/umbp/kv",
            "ssd_bytes_per_rank": 1 << 30,
            "pool": "embedded",
        },
    }
    status, stdout, stderr, r = check(tmp_path, config, "--requests", "3", "--prefix-blocks", "5")
    assert status == 0, stdout + stderr
    assert r["form"] == "kv_transfer_config" and r["load_mode"] == "async"
    assert r["index"].startswith("the pool, embedded")
    assert r["saved_blocks"] == {"ssd": 5 + 3 * 2}
    assert r["hit_blocks"] == r["verified_blocks"] == r["expected_hit_blocks"] == 3 * 5
    assert r["loaded_blocks"] == {"ssd": 15}
    assert r["verified_bytes"] == 15 * BLOCK


def test_a_dram_tier_too_small_for_the_prefix_fails_the_check_with_the_hits_it_got(tmp_path):
    # Two slots and no SSD tier: the prompts' own blocks, saved last, evict the shared ones.
    status, stdout, stderr, r = check(tmp_path, {"dram_bytes_per_rank": 2 * BLOCK})
    assert status == 1, stdout + stderr
    assert r["hit_blocks"] == r["verified_blocks"] < r["expected_hit_blocks"] == 32
    assert r["ok"] is False
    assert f"FAILED: the second pass hit {r['hit_blocks']} blocks" in stdout


@pytest.mark.parametrize(
    "config, named",
    [
        ({"dram_bytes_per_rnk": 1 << 20}, "dram_bytes_per_rnk"),
        ({"load_mode": "eager"}, "load_mode"),
        (
            {"kv_connector": "UmbpConnector", "kv_rol": "kv_both", "kv_connector_extra_config": {}},
            "kv_rol",
        ),
        ({"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {}}, "kv_connector"),
    ],
)
def test_a_bad_config_exits_2_with_the_error_naming_the_key(tmp_path, config, named):
    status, stdout, stderr, r = check(tmp_path, config)
    assert status == 2, stdout + stderr
    assert r is None
    assert named in stderr and "error:" in stderr
