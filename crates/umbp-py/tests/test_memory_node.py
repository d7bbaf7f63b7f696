"""The memory node as the package installs it: the ``umbp-ucx-serve`` console script (and
``python -m umbp.memory_node``), run as a user runs it, with no Rust toolchain: its flags, a
client's bytes through it, and its stop on SIGTERM or SIGINT with the command's status."""

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import umbp
from memory_node import SECRET, serve_binary

PAGE = 64 << 10


def _run(*args):
    return subprocess.run([serve_binary(), *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_the_console_script_is_the_memory_node_command():
    out = _run("--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--region", "--secret-file", "--pool", "--node-id", "--metrics", "--drain-timeout-ms"):
        assert flag in out.stdout, flag
    version = _run("--version")
    assert version.returncode == 0 and umbp.__version__ in version.stdout, version
    # Bad flags: status 2, as the binary; no secret and no --insecure-no-auth: it refuses to
    # serve (status 1, saying why), never serving whoever connects.
    bad = _run("--no-such-flag")
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr, bad
    env = {k: v for k, v in os.environ.items() if k != "UMBP_UCX_SECRET"}
    unsafe = subprocess.run([serve_binary(), "--listen", "127.0.0.1:0", "--region", "kv=1MiB"],
                            capture_output=True, text=True, timeout=120, env=env,
                            stdin=subprocess.DEVNULL)
    assert unsafe.returncode != 0 and "listening" not in unsafe.stdout, unsafe
    assert "secret" in unsafe.stderr, unsafe.stderr


def _start(tmp_path, command):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    os.chmod(secret, 0o600)
    proc = subprocess.Popen(
        [*command, "--listen", "127.0.0.1:0", "--region", f"kv={16 * PAGE}",
         "--secret-file", str(secret), "--transports", "tcp"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RUST_LOG": "info"},
    )
    log = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    for line in proc.stdout:
        if line.startswith("listening "):
            return proc, line.split()[1], log
    proc.wait()
    pytest.fail(f"the node exited with {proc.returncode}: {''.join(log)}")


@pytest.mark.parametrize(
    "how, stop",
    [("script", signal.SIGTERM), ("python -m", signal.SIGINT)],
)
def test_a_node_started_from_the_package_serves_bytes_and_drains_on_a_signal(tmp_path, how, stop):
    command = [serve_binary()] if how == "script" else [sys.executable, "-m", "umbp.memory_node"]
    proc, address, log = _start(tmp_path, command)
    try:
        try:
            engine = umbp.Engine(remote=True, remote_transports="tcp", remote_secret=SECRET)
        except umbp.Error as e:
            if os.environ.get("UMBP_REQUIRE_UCX") == "1":
                raise
            pytest.skip(f"no remote tier here: {e}")
        peer = engine.connect(address)
        assert [(r.name, r.length, r.writable) for r in peer.regions] == [("kv", 16 * PAGE, True)]
        data = (np.arange(4 * PAGE) % 251).astype(np.uint8)
        back = np.zeros(4 * PAGE, dtype=np.uint8)
        with engine.register_remote(peer.region("kv")) as remote, engine.register(data) as src, \
                engine.register(back) as dst:
            pages = [9 * PAGE, 2 * PAGE, 14 * PAGE, 5 * PAGE]
            engine.offload([umbp.Object(1, remote, pages, PAGE, 4 * PAGE,
                                        [umbp.Range(0, 4 * PAGE, src, 0)])]).raise_for_errors()
            engine.restore([umbp.Object(2, remote, pages, PAGE, 4 * PAGE,
                                        [umbp.Range(0, 4 * PAGE, dst, 0)])]).raise_for_errors()
            assert bytes(back) == bytes(data)
        engine.close()
        proc.send_signal(stop)
        assert proc.wait(timeout=120) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(log)
    assert "draining on a signal" in text and "stopped" in text, text
    assert "KeyboardInterrupt" not in text, text
