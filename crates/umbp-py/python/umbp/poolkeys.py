"""The pool's keys of an integration's extra config, one vocabulary for every integration:
:class:`PoolKeys` (``pool``, ``pool_node``, ``pool_save_to``, ``remote_secret_file``...), their
checks and what follows from them (the memory nodes' secret, the index to open, a node id that
outlives a restart). :class:`umbp.vllm.config.UmbpConfig` (vLLM's
``kv_connector_extra_config``) and :class:`umbp.sglang.UmbpStorageConfig` (SGLang's
``--hicache-storage-backend-extra-config``) both inherit it; docs/VLLM.md and docs/SGLANG.md
explain each key.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Sequence

from . import ChecksumPolicy
from .kvpool import SAVE_LOCAL, SAVE_TO

if TYPE_CHECKING:
    from ._native import PoolIndex

__all__ = ["PoolKeys", "open_index", "default_node"]

#: The environment variable holding the memory nodes' shared secret.
SECRET_ENV = "UMBP_UCX_SECRET"

#: The environment variable holding the Redis password (it overrides the URL's), which keeps
#: it off the command line.
PASSWORD_ENV = "UMBP_POOL_PASSWORD"


@dataclass(frozen=True)
class PoolKeys:
    """The pool's extra-config keys (all optional: without ``pool`` none is used)."""

    pool: Optional[str] = None
    pool_node: Optional[int] = None
    pool_namespace: Optional[str] = None
    pool_lease_s: float = 30.0
    pool_reserve_s: float = 120.0
    pool_announce_s: float = 15.0
    pool_save_to: str = SAVE_LOCAL
    remote_secret_file: Optional[str] = None
    remote_transports: Optional[str] = None
    remote_lanes: int = 2
    remote_congestion: str = "auto"
    remote_connect_wait_s: float = 0.05

    @classmethod
    def refuse_unknown(cls, keys: Iterable[str], who: str) -> None:
        """Raises ``ValueError`` naming every key of ``keys`` that is no field of this
        configuration (``who`` says whose and which extra config): a typo must not silently
        fall back to a default."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(keys) - known)
        if unknown:
            raise ValueError(f"{who} keys {unknown}; known: {sorted(known)}")

    def check_pool_keys(self, who: str, *, ssd_path: Optional[str], checksums: str) -> None:
        """Checks the pool's keys (``who`` starts each message: ``"UmbpConnector"``,
        ``"umbp.sglang"``); a bad value raises ``ValueError`` naming its key. ``ssd_path``:
        the integration's SSD tier (an embedded pool lies beside it); ``checksums``: its
        checksum policy (a pool records every block's checksum: it cannot be off)."""
        if self.pool is not None:
            if not isinstance(self.pool, str) or not self.pool:
                raise ValueError(f"{who}: pool must be 'embedded', a path or a redis:// URL")
            if self.pool == "embedded" and not ssd_path:
                raise ValueError(
                    f"{who}: the embedded pool lies beside the SSD tier: it needs ssd_path"
                )
            if checksums == ChecksumPolicy.OFF.value:
                raise ValueError(
                    f"{who}: a pool records each block's checksum: checksums cannot be off"
                )
        if self.pool_node is not None and not (
            isinstance(self.pool_node, int)
            and not isinstance(self.pool_node, bool)
            and 0 <= self.pool_node < 1 << 32
        ):
            raise ValueError(f"{who}: pool_node must be an integer in [0, 2**32)")
        if self.pool_namespace is not None and not isinstance(self.pool_namespace, str):
            raise ValueError(f"{who}: pool_namespace must be a string")
        if not (
            isinstance(self.remote_lanes, int)
            and not isinstance(self.remote_lanes, bool)
            and 1 <= self.remote_lanes <= 64
        ):
            raise ValueError(f"{who}: remote_lanes must be an integer from 1 to 64")
        if not isinstance(self.remote_congestion, str) or not self.remote_congestion:
            raise ValueError(
                f"{who}: remote_congestion must be 'auto', 'system' or an algorithm's name"
            )
        if not _number(self.remote_connect_wait_s) or not float(self.remote_connect_wait_s) >= 0:
            raise ValueError(f"{who}: remote_connect_wait_s must be a number >= 0")
        for name in ("pool_lease_s", "pool_reserve_s", "pool_announce_s"):
            value = getattr(self, name)
            if not _number(value) or not float(value) > 0:
                raise ValueError(f"{who}: {name} must be positive")
        if self.pool_save_to not in SAVE_TO:
            raise ValueError(f"{who}: pool_save_to must be one of {SAVE_TO}")
        if self.pool_save_to != SAVE_LOCAL:
            if self.pool is None or "://" not in self.pool:
                raise ValueError(
                    f"{who}: memory nodes join a Redis pool: pool_save_to "
                    f"{self.pool_save_to!r} needs \"pool\": \"redis://...\""
                )
            if not self.memory_nodes():
                raise ValueError(
                    f"{who}: pool_save_to {self.pool_save_to!r} needs the memory nodes' "
                    f"shared secret: remote_secret_file, or the {SECRET_ENV} environment "
                    "variable"
                )
        if self.remote_secret_file is not None and not os.path.isfile(self.remote_secret_file):
            raise ValueError(f"{who}: remote_secret_file {self.remote_secret_file!r} is not a file")

    def memory_nodes(self) -> bool:
        """Whether memory nodes of the pool are reached: a Redis pool, and the nodes' shared
        secret (``remote_secret_file``, or ``UMBP_UCX_SECRET``). Their blocks are then
        hits."""
        return (
            self.pool is not None
            and "://" in self.pool
            and (self.remote_secret_file is not None or bool(os.environ.get(SECRET_ENV)))
        )

    def remote_secret(self) -> Optional[bytes]:
        """The memory nodes' secret from ``remote_secret_file`` (one trailing newline dropped,
        as the node reads its own), or None: the engine reads ``UMBP_UCX_SECRET``."""
        if self.remote_secret_file is None:
            return None
        with open(self.remote_secret_file, "rb") as f:
            secret = f.read()
        return secret[:-1] if secret.endswith(b"\n") else secret

    def seal_secret(self) -> Optional[bytes]:
        """The secret the pool's Redis entries are sealed under: the memory nodes' one, where
        they are reached (a Redis writer without it cannot then make an entry that is taken
        for a hit); None otherwise (entries are still bound to their keys). Every instance of
        one pool must agree, as they must to reach the memory nodes at all."""
        if not self.memory_nodes():
            return None
        secret = self.remote_secret()
        if secret is None:
            secret = os.environ.get(SECRET_ENV, "").encode() or None
        return secret

    def remote_options(self) -> Dict[str, Any]:
        """The :class:`umbp.Engine` keyword arguments of the remote tier, where the pool's
        memory nodes are reached (none without them)."""
        if not self.memory_nodes():
            return {}
        return dict(
            remote=True,
            remote_transports=self.remote_transports,
            remote_secret=self.remote_secret(),
            remote_lanes=self.remote_lanes,
            remote_congestion=self.remote_congestion,
        )

    def pool_checksums(self, checksums: str, *, durable: bool) -> str:
        """The engine's checksum policy given the configured ``checksums``: a pool publishes
        every block with its checksum, so a pool whose blocks go to DRAM (``durable``: they
        go to an SSD file) hashes DRAM too."""
        if self.pool is not None and not durable:
            return ChecksumPolicy.ALL_TIERS.value
        return checksums


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def open_index(target: str, seal: Optional[bytes]) -> "PoolIndex":
    """The pool index at ``target`` (a redb file's path or a ``redis://`` URL), the password
    from ``UMBP_POOL_PASSWORD`` where set (it overrides the URL's), entries sealed under
    ``seal`` (:meth:`PoolKeys.seal_secret`)."""
    from ._native import PoolIndex

    return PoolIndex(target, password=os.environ.get(PASSWORD_ENV) or None, secret=seal)


def default_node(files: Sequence[str], salt: str) -> int:
    """A node id for an instance that names none (``pool_node``): stable across restarts where
    the instance has SSD files (``files``: their absolute paths; its blocks outlive it), else
    new at every start (``salt`` tells apart instances of one process)."""
    seed = f"{socket.gethostname()}|" + (
        "|".join(files) if files else f"{os.getpid()}|{salt}|{time.time_ns()}"
    )
    return int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=4).digest(), "big")
