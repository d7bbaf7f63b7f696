"""The build backend of the ``umbp`` package: maturin's, behind a check that Rust is installed.

Building from source compiles the Rust crates, so it needs ``cargo``. Without it on ``PATH``,
maturin's backend would silently download a whole Rust toolchain (about 900 MB, through
``puccinialin``) into a temporary directory; this backend stops with a message saying what to
do instead. ``UMBP_BUILD_DOWNLOAD_RUST=1`` asks for maturin's download after all.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, List, Mapping, Optional

import maturin as _maturin

#: The message of a build without ``cargo``.
NO_CARGO = """
error: building umbp from source needs Rust, and `cargo` is not on PATH.

  - install Rust (rustup: https://rustup.rs, then open a new shell or `. "$HOME/.cargo/env"`)
    and install again; or
  - install a prebuilt wheel instead: `pip install umbp-<version>-...-manylinux_2_28_x86_64.whl`
    (CI builds them: see the README).

Set UMBP_BUILD_DOWNLOAD_RUST=1 to let maturin download a temporary Rust toolchain (~900 MB).
"""


def _require_cargo() -> None:
    """Exits with :data:`NO_CARGO` unless cargo is on PATH (or the download is asked for)."""
    if os.environ.get("UMBP_BUILD_DOWNLOAD_RUST") == "1":
        return
    # maturin's own hooks download a toolchain unless this is set.
    os.environ["MATURIN_NO_INSTALL_RUST"] = "1"
    if shutil.which("cargo") is None:
        sys.stderr.write(NO_CARGO)
        sys.stderr.flush()
        raise SystemExit(1)


def get_requires_for_build_wheel(config_settings: Optional[Mapping[str, Any]] = None) -> List[str]:
    _require_cargo()
    return list(_maturin.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(
    config_settings: Optional[Mapping[str, Any]] = None,
) -> List[str]:
    _require_cargo()
    return list(_maturin.get_requires_for_build_editable(config_settings))


def get_requires_for_build_sdist(config_settings: Optional[Mapping[str, Any]] = None) -> List[str]:
    _require_cargo()
    return list(_maturin.get_requires_for_build_sdist(config_settings))


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: Optional[Mapping[str, Any]] = None
) -> str:
    _require_cargo()
    return str(_maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings))


def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: Optional[Mapping[str, Any]] = None
) -> str:
    _require_cargo()
    return str(_maturin.prepare_metadata_for_build_editable(metadata_directory, config_settings))


def build_wheel(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    _require_cargo()
    return str(_maturin.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(
    wheel_directory: str,
    config_settings: Optional[Mapping[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    _require_cargo()
    return str(_maturin.build_editable(wheel_directory, config_settings, metadata_directory))


def build_sdist(sdist_directory: str, config_settings: Optional[Mapping[str, Any]] = None) -> str:
    _require_cargo()
    return str(_maturin.build_sdist(sdist_directory, config_settings))
