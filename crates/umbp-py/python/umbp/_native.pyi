"""Type stubs of the Rust half of umbp (see umbp/__init__.py for the public API)."""

from typing import Any, Callable, Dict, List, Optional, Tuple, Union, final

from . import FailureKind, RejectKind

__all__ = [
    "Engine",
    "Registration",
    "Batch",
    "Server",
    "Error",
    "RegistrationError",
    "RejectedError",
    "TransferError",
    "CancelledError",
    "ClosedError",
    "CUDA",
    "__version__",
    "reset_log_cache",
    "crc32c_combine",
]

CUDA: bool
__version__: str

def reset_log_cache() -> None: ...
def crc32c_combine(first: int, second: int, second_len: int) -> int: ...

class Error(Exception):
    # The caller's tag of the object whose error this is (None when no object is behind it).
    tag: Optional[int]
class RegistrationError(Error):
    errno: Optional[int]
# `reason`, `kind`, `engine` and `cause` are set on every instance the engines raise.
class RejectedError(Error):
    reason: str
    kind: RejectKind
class TransferError(Error):
    engine: str
    cause: str
    kind: FailureKind
    errno: Optional[int]
    device_code: Optional[int]
class CancelledError(Error): ...
class ClosedError(Error): ...

_Result = Tuple[str, List[Tuple[int, str, Optional[Error], Optional[int]]]]
_Range = Tuple[int, int, Union["Registration", int], int, int]
_Object = Tuple[int, Union["Registration", int], bytes, int, int, List[_Range]]

@final
class Registration:
    @property
    def id(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def label(self) -> Optional[str]: ...
    def _set_label(self, label: str) -> None: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Registration": ...
    def __exit__(self, *exc: Any) -> bool: ...

@final
class Batch:
    def done(self) -> bool: ...
    def state(self, tag: int) -> Optional[str]: ...
    def report(self) -> _Result: ...
    def wait(self, timeout: Optional[float] = None) -> Optional[_Result]: ...
    def wait_group(self, group: int, timeout: Optional[float] = None) -> bool: ...
    def wait_group_enqueued(self, group: int, timeout: Optional[float] = None) -> bool: ...
    def group_event(self, group: int, timeout: Optional[float] = None) -> Optional[int]: ...
    def cancel(self) -> _Result: ...
    def call_when_done(self, callback: Callable[[], None]) -> None: ...

@final
class Engine:
    def __new__(
        cls,
        *,
        device: str = "sim",
        sim_devices: int = 1,
        pin_device: Optional[int] = ...,
        workers: int = 8,
        bounce_bytes: int = ...,
        ssd_queue_depth: int = 64,
        ssd_worker_cpus: Optional[List[int]] = None,
        remote: bool = False,
        remote_transports: Optional[str] = None,
        remote_secret: Optional[bytes] = None,
        remote_insecure_no_auth: bool = False,
        checksums: str = "files_and_remote",
    ) -> "Engine": ...
    @property
    def device_kind(self) -> str: ...
    def connect(self, addr: str) -> Tuple[int, List[Tuple[int, str, int, bool]]]: ...
    def disconnect(self, peer: int) -> None: ...
    def register_remote(self, peer: int, region: int, offset: int, length: int) -> Registration: ...
    def register_host(self, addr: int, length: int, owner: object) -> Registration: ...
    def register_device(self, device: int, addr: int, length: int, owner: object) -> Registration: ...
    def register_file(
        self,
        path: str,
        offset: int,
        length: int,
        *,
        direct: bool = True,
        writable: bool = True,
        create: bool = False,
        extend: bool = False,
        exclusive: bool = False,
    ) -> Registration: ...
    def alloc_device(self, length: int, device: int = 0) -> Registration: ...
    def read(self, source: Registration, offset: int, length: int) -> bytes: ...
    def write(self, target: Registration, offset: int, data: bytes) -> None: ...
    def start(
        self,
        objects: List[_Object],
        restore: bool,
        timeout: Optional[float] = None,
        stream: Optional[int] = None,
        stream_device: int = 0,
        checksums: Optional[List[Optional[int]]] = None,
    ) -> Batch: ...
    def metrics(self) -> Dict[str, Dict[Any, Any]]: ...
    def metrics_text(self) -> str: ...

@final
class Server:
    def __new__(
        cls,
        listen: str,
        regions: List[Tuple[str, int, int, bool, object]],
        transports: Optional[str] = None,
        secret: Optional[bytes] = None,
        insecure_no_auth: bool = False,
    ) -> "Server": ...
    @property
    def address(self) -> str: ...
    @property
    def clients(self) -> int: ...
    def close(self) -> None: ...
