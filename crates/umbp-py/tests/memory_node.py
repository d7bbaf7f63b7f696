"""A real memory node for the Python tests: ``umbp-ucx-serve`` (the command a user runs, the
package's console script) on loopback, exporting one region, joining a pool in a redis-server
the test started, killed at the end.

The command: ``UMBP_UCX_SERVE`` names one (the Rust binary of crate umbp-memory-node, say);
else the console script the package installed beside this Python, so the tests run the node
as a user who installed the wheel does, with no Rust toolchain. UCX missing (the command
cannot start): the test skips with the reason printed, or fails where ``UMBP_REQUIRE_UCX=1``."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from redis_server import PASSWORD, Child

#: The shared secret of the node and its clients (``remote_secret_file`` in the connector).
SECRET = b"umbp vllm pool tests: a secret 32+ bytes"


def _unavailable(reason):
    if os.environ.get("UMBP_REQUIRE_UCX") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def serve_binary():
    """The path of ``umbp-ucx-serve`` (see the module)."""
    exe = os.environ.get("UMBP_UCX_SERVE")
    if exe:
        return exe
    script = Path(sys.executable).parent / "umbp-ucx-serve"
    if not script.exists():
        pytest.fail(f"the package's console script is not installed beside {sys.executable}")
    return str(script)


class MemoryNode(Child):
    """``umbp-ucx-serve`` as node ``node_id`` of the pool at ``redis`` (a redis_server.Redis),
    one writable region of ``slots`` slots of ``slot_size`` bytes (tier 0 of the node), its
    announcement lasting ``ttl_ms`` (killed, it lapses after that)."""

    def __init__(self, tmp, redis, *, node_id, slot_size, slots, ttl_ms=1000):
        self.dir = tmp / f"node-{node_id}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.dir / "secret"
        self.secret_file.write_bytes(SECRET + b"\n")
        os.chmod(self.secret_file, 0o600)
        password = self.dir / "redis-password"
        password.write_text(PASSWORD + "\n")
        os.chmod(password, 0o600)
        self.node_id = node_id
        self.ttl_ms = ttl_ms
        self.args = [
            serve_binary(),
            "--listen", "127.0.0.1:0",
            "--region", f"kv={slots * slot_size}",
            "--secret-file", str(self.secret_file),
            "--transports", "tcp",
            "--pool", f"redis://127.0.0.1:{redis.port}/",
            "--pool-password-file", str(password),
            "--node-id", str(node_id),
            "--pool-slot-size", str(slot_size),
            "--pool-ttl-ms", str(ttl_ms),
        ]
        self.log = []
        self.proc = None
        self.address = None
        self.start()

    def start(self):
        """Starts it and waits for ``listening`` (printed once it joined the pool)."""
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RUST_LOG": "info"},
        )
        err = self.proc.stderr
        threading.Thread(target=lambda: self.log.extend(err), daemon=True).start()
        for line in self.proc.stdout:
            if line.startswith("listening "):
                self.address = line.split()[1]
                return
        rc = self.proc.wait()
        time.sleep(0.2)
        text = "".join(self.log[-40:])
        if "libucp" in text or "UCX" in text and "load" in text:
            _unavailable(f"umbp-ucx-serve cannot start here (UCX missing?): {text[-2000:]}")
        pytest.fail(f"umbp-ucx-serve exited with {rc} at start:\n{text}")

    def restart(self):
        """Starts it again at the address it had (killed before): the same node id and
        address, empty, as a restarted service."""
        self.stop()
        self.args[self.args.index("--listen") + 1] = self.address
        deadline = time.monotonic() + 30
        while True:
            try:
                self.start()
                return
            except pytest.fail.Exception:
                # The port may linger a moment after the kill.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)



@pytest.fixture
def memory_node(tmp_path, redis):
    """Makes memory nodes in the test's redis-server: ``memory_node(node_id=..., ...)``;
    each is killed at the end."""
    nodes = []

    def make(**kw):
        n = MemoryNode(tmp_path, redis, **kw)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.stop()
