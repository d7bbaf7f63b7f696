"""What the package ships: its version, its licenses, and a clear error (not a toolchain
download) when it is built from source on a machine without Rust."""

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import umbp

#: The crate's directory (pyproject.toml, Cargo.toml), next to this test's folder.
CRATE = Path(__file__).resolve().parent.parent


def test_the_version_is_the_crates_and_the_installed_distributions():
    cargo = (CRATE / "Cargo.toml").read_text()
    crate_version = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    assert umbp.__version__ == crate_version
    assert importlib.metadata.version("umbp") == umbp.__version__
    assert "__version__" in umbp.__all__


def test_the_installed_distribution_carries_both_licenses():
    dist = importlib.metadata.distribution("umbp")
    assert dist.metadata["License-Expression"] == "MIT OR Apache-2.0"
    assert sorted(dist.metadata.get_all("License-File")) == ["LICENSE-APACHE", "LICENSE-MIT"]
    mit = dist.read_text("licenses/LICENSE-MIT")
    apache = dist.read_text("licenses/LICENSE-APACHE")
    assert mit is not None and mit.startswith("Copyright (c) 2026 umbp developers")
    assert "Permission is hereby granted, free of charge" in mit
    assert apache is not None and "Apache License" in apache and "Version 2.0" in apache


def _path_without_cargo():
    """PATH with every folder holding a `cargo` left out."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in folders if d and not os.path.exists(os.path.join(d, "cargo")))


def test_building_from_source_without_cargo_stops_with_what_to_do(tmp_path):
    """pip builds the package from source with the package's own backend: on a machine
    without cargo it must say to install Rust or a wheel, not download a toolchain. Runs pip
    offline (no index, and a proxy that refuses every connection), so a download attempt
    fails here instead of fetching 900 MB."""
    if importlib.util.find_spec("maturin") is None:
        pytest.skip("maturin is not installed here (pip install maturin): the backend wraps it")
    path = _path_without_cargo()
    assert shutil.which("cargo", path=path) is None
    env = dict(os.environ, PATH=path, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[proxy] = "http://127.0.0.1:9"  # the discard port: nothing listens
    env.pop("UMBP_BUILD_DOWNLOAD_RUST", None)
    env.pop("MATURIN_NO_INSTALL_RUST", None)
    # A copy of the package's sources, so no build output lands in the tree.
    src = tmp_path / "umbp-py"
    shutil.copytree(CRATE, src, symlinks=False, ignore=shutil.ignore_patterns(
        "*.so", "__pycache__", "target", "tests", "bench"))
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
         "--target", str(tmp_path / "installed"), str(src)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "install Rust (rustup" in output, output
    assert "install a prebuilt wheel" in output, output
    assert "installing into a temporary directory" not in output, output
    assert not (tmp_path / "installed" / "umbp").exists()
