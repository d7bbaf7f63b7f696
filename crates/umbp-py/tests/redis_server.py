"""A real redis-server for the pool's Python tests: started on loopback with a password, a
fresh port and a temp directory, without persistence (a restart forgets everything, as a lost
server does), and killed at the end. Absent redis-server: the test skips with the reason
printed, or fails where UMBP_REQUIRE_REDIS=1 (CI installs it)."""

import os
import shutil
import socket
import subprocess
import time

import pytest

PASSWORD = "umbp-test-secret"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A process a test started (``self.proc``): killed when the test ends."""

    proc = None

    def kill(self):
        """SIGKILL: the process is gone at once, with everything it held."""
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        """Kills it if it still runs (the end of a test)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


class Redis(Child):
    def __init__(self, tmp):
        self.exe = shutil.which("redis-server")
        self.dir = tmp / "redis"
        self.dir.mkdir(exist_ok=True)
        self.port = free_port()
        self.proc = None
        self.start()

    @property
    def url(self):
        """The URL a client connects with (the password in it)."""
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/"

    def start(self):
        """Starts the server (again, on the same port, empty) and waits until it answers."""
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--requirepass", PASSWORD,
                "--dir", str(self.dir),
                "--save", "",
                "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(f"AUTH {PASSWORD}\r\nPING\r\n".encode())
                    got = b""
                    while b"PONG" not in got:
                        more = s.recv(64)
                        if not more:
                            break
                        got += more
                    if b"PONG" in got:
                        return
            except OSError:
                pass
            assert self.proc.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.05)


@pytest.fixture
def redis(tmp_path):
    if shutil.which("redis-server") is None:
        if os.environ.get("UMBP_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed (UMBP_REQUIRE_REDIS=1)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    r = Redis(tmp_path)
    yield r
    r.stop()
