"""umbp: transfer engines for a tiered KV cache, from Python.

An inference server keeps cached KV blocks in GPU memory, host memory and SSD files. Before
the first token of a request that hits a cached prefix it *restores* that prefix into GPU
memory, layer group by layer group; when GPU memory fills it *offloads* blocks down the tiers.
``umbp`` moves those paged objects in batches: one call carries many objects, each object
succeeds or fails on its own (a bad page or a failed read costs one object, never another),
and a batch can be waited for layer group by layer group while the next groups still move.

Example::

    import numpy as np, umbp

    engine = umbp.Engine()                                  # host copies, a simulated GPU, SSD
    dram = np.arange(1 << 20, dtype=np.uint8)               # a DRAM tier of 16 pages of 64 KiB
    with engine.register(dram) as tier, engine.alloc_device(256 << 10) as kv:
        obj = umbp.Object(tag=7, tier=tier, page_offsets=[3 << 16, 9 << 16], page_size=1 << 16,
                          size=128 << 10, ranges=[umbp.Range(0, 128 << 10, kv, 0)])
        report = engine.restore([obj])                      # or start_restore(...) -> Batch
        report.raise_for_errors()
        assert engine.read(kv, 0, 1 << 16) == dram[3 << 16:4 << 16].tobytes()

Lifetimes: a registration holds what it registered (the array's buffer, the tensor) until it
is closed or garbage-collected, and closing waits for the batches that use it; so ``del
array`` while a batch is in flight is safe. Threads: every call may come from any thread;
planning and waiting release the GIL. Errors derive from :class:`Error`; an object's error
carries its ``tag`` and a typed ``kind`` (:class:`RejectKind`, :class:`FailureKind`).
States are :class:`State` members (strings too: ``State.COMPLETED == "completed"``).

Logs: the Rust crates' ``tracing`` events go to :mod:`logging`, to the logger named after the
event's Rust module (``umbp_ssd.engine``, ``umbp_remote.server``, ``umbp_composite.builder``...;
configure them all through their prefixes, ``logging.getLogger("umbp_remote")``). Warnings and
errors reach the root logger's handlers by default; after changing a logger's level, call
:func:`reset_log_cache`, since the Rust side caches each logger's level.
"""

# Aliased, as every import here, so that dir(umbp) lists the package's own names only.
from __future__ import annotations as _annotations

import array as _array
import asyncio as _asyncio
import ctypes as _ctypes
import enum as _enum
import os as _os
import re as _re
import stat as _stat
import threading as _threading
import weakref as _weakref
import dataclasses as _dc
import typing as _t

from . import _native
from ._native import (  # noqa: F401  (re-exported)
    CancelledError,
    ClosedError,
    DuplicateTagError,
    Error,
    RegistrationError,
    RejectedError,
    TransferError,
    crc32c_combine,
    reset_log_cache,
)
from . import pool as _pool
# The pool's public names are the ones umbp.pool.__all__ lists, and nowhere else: they are
# re-exported here and added to this package's __all__ below.
from .pool import *  # noqa: F401,F403  (re-exported)

#: The package's version (the Rust crate's, which the wheel's metadata carries too).
__version__: str = _native.__version__

__all__ = [
    "__version__",
    "State",
    "RejectKind",
    "FailureKind",
    "ChecksumPolicy",
    "UnknownKeyError",
    "reset_log_cache",
    "crc32c_combine",
    "Engine",
    "Registration",
    "Object",
    "Range",
    "Batch",
    "Report",
    "Metrics",
    "EngineCounters",
    "InFlight",
    "ChecksumCounters",
    "ObjectResult",
    "Error",
    "RegistrationError",
    "RejectedError",
    "TransferError",
    "CancelledError",
    "ClosedError",
    "DuplicateTagError",
    "CUDA",
    "Peer",
    "RemoteRegion",
    "Server",
]
__all__ += _pool.__all__

#: The Rust half of :class:`Engine` (an alias, so that an annotation inside the class does not
#: meet the class's own ``_native`` property).
_NativeEngine = _native.Engine

#: Whether this build has the CUDA backend (``Engine(device="cuda")``).
CUDA: bool = _native.CUDA


class _StrEnum(str, _enum.Enum):
    """An enum whose members are also their strings: ``State.COMPLETED == "completed"``, and
    ``str()`` / f-strings give the value on every Python version."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class State(_StrEnum):
    """Where an object (:attr:`ObjectResult.state`, :meth:`Batch.state`) or a whole batch
    (:attr:`Report.aggregate`: ``IN_FLIGHT``, ``COMPLETED``, ``CANCELLED`` or ``FAILED``)
    stands."""

    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    REJECTED = "rejected"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @classmethod
    def _missing_(cls, value: object) -> _t.Optional["State"]:
        # Reports spelled the aggregate "inflight" before 0.1.1.
        return cls.IN_FLIGHT if value == "inflight" else None

    @property
    def settled(self) -> bool:
        """Whether the state is final (anything but ``IN_FLIGHT``)."""
        return self is not State.IN_FLIGHT


class RejectKind(_StrEnum):
    """Why an object was refused while planning (:attr:`RejectedError.kind`)."""

    UNKNOWN_ENDPOINT = "unknown_endpoint"
    PAIR_NOT_HANDLED = "pair_not_handled"
    OUT_OF_BOUNDS = "out_of_bounds"
    OVERFLOW = "overflow"
    SEGMENT_TOO_LONG = "segment_too_long"
    BUILDER_PANICKED = "builder_panicked"
    READ_ONLY = "read_only"
    MISALIGNED = "misaligned"
    #: Its ranges or pages do not describe an object (zero-length, past its end...).
    INVALID_OBJECT = "invalid_object"
    OTHER = "other"


class FailureKind(_StrEnum):
    """Why a transfer carrying an object's bytes failed (:attr:`TransferError.kind`)."""

    #: The system failed the I/O (``.errno``; ``__cause__`` is the matching ``OSError``).
    IO = "io"
    SHORT_FILE = "short_file"
    #: The device runtime failed (``.device_code``).
    DEVICE = "device"
    ENDPOINT_GONE = "endpoint_gone"
    NOT_ACCEPTED = "not_accepted"
    OVERLAP = "overlap"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    PEER_FAILED = "peer_failed"
    PANICKED = "panicked"
    #: The object's bytes arrived but their CRC32C is not the :attr:`Object.checksum` given:
    #: the block in the tier is not the block that was saved. A load error: recompute it.
    CHECKSUM_MISMATCH = "checksum_mismatch"
    #: A checksum was given but part of the object moved where it never sits in host memory
    #: (device to device), so it could not be verified; it fails rather than load unverified.
    CHECKSUM_UNVERIFIABLE = "checksum_unverifiable"
    OTHER = "other"


class ChecksumPolicy(_StrEnum):
    """Which tiers' objects get a CRC32C (``Engine(checksums=...)``): offloads report it
    (:attr:`ObjectResult.checksum`), restores given one (:attr:`Object.checksum`) verify it."""

    #: Nothing is hashed.
    OFF = "off"
    #: Objects in an SSD file or a remote node (the default): their bytes cross host memory
    #: anyway, and hashing them costs a small share of the load.
    FILES_AND_REMOTE = "files_and_remote"
    #: Every tier, DRAM included: hashed while copied where the CPU copies (host copies, the
    #: simulated device), beside the copy where a GPU's DMA reads the DRAM pages.
    ALL_TIERS = "all_tiers"


class UnknownKeyError(Error, KeyError):
    """A key that nothing is cached for (:meth:`umbp.connector.KVConnector.start_load`). Also
    a ``KeyError``, as it was before it was an :class:`Error`."""

    def __init__(self, key: _t.Any):
        super().__init__(key)
        #: The key asked for.
        self.key = key

    def __str__(self) -> str:
        return f"nothing is cached for key {self.key!r}"

#: A registered endpoint (see :meth:`Engine.register`): ``id``, ``length``, ``kind``
#: (``"host"``, ``"device"``, ``"file"``), ``closed``; ``close()`` or a ``with`` block ends it.
#: ``close()`` waits for the batches using it; from any number of threads at once, each
#: returns only once the registration has ended. Used once closed (or while closing), it
#: raises :class:`ClosedError`. It belongs to the engine that made it: another engine refuses
#: it (``ValueError``).
Registration = _native.Registration


@_dc.dataclass(frozen=True)
class Range:
    """Bytes ``offset .. offset + length`` of an object, at ``endpoint_offset`` of ``endpoint``
    (the destination of a restore, the source of an offload), in layer group ``group``.

    ``offset``, ``length`` and ``endpoint_offset`` are integers from 0 to 2**64 - 1 and
    ``group`` from 0 to 2**32 - 1; anything else raises ``ValueError`` here, when the range
    is made, not when a batch carrying it starts."""

    offset: int
    length: int
    endpoint: _t.Union[Registration, int]
    endpoint_offset: int
    group: int = 0

    def __post_init__(self) -> None:
        _check_int("Range.offset", self.offset, 64)
        _check_int("Range.length", self.length, 64)
        _check_int("Range.endpoint_offset", self.endpoint_offset, 64)
        _check_int("Range.group", self.group, 32)
        if not isinstance(self.endpoint, Registration):
            _check_int("Range.endpoint", self.endpoint, 64)


def _check_int(name: str, value: _t.Any, bits: int) -> None:
    """Raises ``ValueError`` unless ``value`` is an integer in ``0 .. 2**bits``."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, not {value!r}") from None
    if number != value or not 0 <= number < 1 << bits:
        raise ValueError(f"{name} must be an integer from 0 to 2**{bits} - 1, not {value!r}")


@_dc.dataclass(frozen=True)
class Object:
    """A paged object: stored in ``tier`` (a registration) in pages of ``page_size`` bytes
    whose byte offsets in the tier are ``page_offsets`` (a list or a numpy array, in object
    order); ``size`` bytes long; moved as ``ranges``. ``tag`` is your own integer, reported
    back with the object's result. ``checksum``: for a restore, the CRC32C its bytes must have
    (the :attr:`ObjectResult.checksum` the offload that saved them reported); where the
    engine's :class:`ChecksumPolicy` covers the tier, other bytes fail the object with
    :attr:`FailureKind.CHECKSUM_MISMATCH`. Offloads ignore it."""

    tag: int
    tier: _t.Union[Registration, int]
    page_offsets: _t.Any
    page_size: int
    size: int
    ranges: _t.Sequence[Range] = _dc.field(default_factory=list)
    checksum: _t.Optional[int] = None

    def __post_init__(self) -> None:
        # As for Range: a value no batch could carry is refused when the object is made.
        _check_int("Object.tag", self.tag, 64)
        _check_int("Object.page_size", self.page_size, 64)
        _check_int("Object.size", self.size, 64)
        if not isinstance(self.tier, Registration):
            _check_int("Object.tier", self.tier, 64)
        if self.checksum is not None:
            _check_int("Object.checksum", self.checksum, 32)

    def _native(self) -> "_native._Object":
        return (
            int(self.tag),
            self.tier,
            _offsets_bytes(self.page_offsets),
            int(self.page_size),
            int(self.size),
            [
                (int(r.offset), int(r.length), r.endpoint, int(r.endpoint_offset), int(r.group))
                for r in self.ranges
            ],
        )


def _offsets_bytes(offsets: _t.Any) -> bytes:
    """Page offsets as little-endian u64 bytes, without a Python loop for numpy arrays."""
    astype = getattr(offsets, "astype", None)
    if astype is not None:  # numpy (or compatible)
        return bytes(astype("<u8", copy=False).tobytes())
    a = _array.array("Q", offsets)
    if _array.array("Q", [1]).tobytes()[0] != 1:
        a.byteswap()
    return a.tobytes()


def _labeled(registration: Registration, label: _t.Optional[str]) -> Registration:
    """``registration``, named ``label`` in error messages when given."""
    if label is not None:
        registration._set_label(label)
    return registration


class EngineCounters(_t.TypedDict):
    """What one engine moved in one direction since the engine started. Each key is the
    Prometheus counter's name without ``umbp_transfer_`` (``umbp_`` for ``rejected_objects``)
    and ``_total``, summed over the labels it has beyond engine and direction."""

    #: Segments executed (``umbp_transfer_segments_total``).
    segments: int
    #: Bytes executed (``umbp_transfer_bytes_total``).
    bytes: int
    #: Objects whose bytes rode in the engine's plans (``umbp_transfer_objects_total``).
    objects: int
    #: Failed plans or segments, and plans the engine panicked with, all causes
    #: (``umbp_transfer_failures_total``).
    failures: int
    #: Objects rejected while planning, all reasons (``umbp_rejected_objects_total``).
    rejected_objects: int


class InFlight(_t.TypedDict):
    """What is in flight now."""

    #: Batches submitted and not yet settled.
    batches: int
    #: Bytes those batches move.
    bytes: int


class ChecksumCounters(_t.TypedDict):
    """What block checksums found since the engine started."""

    #: Restored objects whose bytes did not match (``umbp_checksum_mismatches_total``).
    mismatches: int
    #: Bytes hashed (``umbp_checksum_bytes_total``).
    bytes: int


class Metrics(_t.TypedDict):
    """:meth:`Engine.metrics`: counters keyed by ``(engine, direction)`` (``("ssd",
    "host->file")``), what is in flight, and what checksums found."""

    engines: _t.Dict[_t.Tuple[str, str], EngineCounters]
    in_flight: InFlight
    checksums: ChecksumCounters


@_dc.dataclass(frozen=True)
class ObjectResult:
    """One object's outcome: ``state`` is a :class:`State` (``COMPLETED``, ``REJECTED``,
    ``FAILED``, ``CANCELLED``, ``IN_FLIGHT``; equal to its string); ``error`` the exception
    explaining anything but completion, whose ``.tag`` is this object's (:class:`RejectedError`
    with ``.reason`` and ``.kind``; :class:`TransferError` with ``.kind``, ``.errno``,
    ``.device_code``, ``.engine``, ``.cause``; :class:`CancelledError`). ``checksum``: the
    CRC32C of the object's bytes (its ranges in order) where the engine's
    :class:`ChecksumPolicy` covers its tier: for an offload, of the bytes it wrote (record it
    with the block, give it back as :attr:`Object.checksum` when loading); for a restore
    given one, of the bytes that arrived; ``None`` otherwise."""

    tag: int
    state: State
    error: _t.Optional[Error] = None
    checksum: _t.Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.state is State.COMPLETED


@_dc.dataclass(frozen=True)
class Report:
    """A batch's results: one :class:`ObjectResult` per object, in the batch's order, and the
    aggregate: :attr:`State.COMPLETED` (every object completed), :attr:`State.CANCELLED`
    (all settled, and every object that did not complete was cancelled: the batch was
    cancelled, nothing in it failed), :attr:`State.FAILED` (all settled, some object
    rejected or failed) or :attr:`State.IN_FLIGHT`."""

    aggregate: State
    objects: _t.List[ObjectResult]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.objects)

    def object(self, tag: int) -> _t.Optional[ObjectResult]:
        return next((o for o in self.objects if o.tag == tag), None)

    def failed(self) -> _t.List[ObjectResult]:
        return [o for o in self.objects if not o.ok]

    def raise_for_errors(self) -> "Report":
        """Raises the first object's error, if any object did not complete."""
        for o in self.objects:
            if o.error is not None:
                raise o.error
        return self

    @staticmethod
    def _from(raw: "_native._Result") -> "Report":
        aggregate, objects = raw
        results = [ObjectResult(t, State(s), e, c) for (t, s, e, c) in objects]
        state = State(aggregate)
        # The engines' aggregate is FAILED once anything did not complete; a batch whose only
        # shortfall is what cancel() skipped reads as cancelled, not as a failure.
        unfinished = [r.state for r in results if r.state is not State.COMPLETED]
        if state is State.FAILED and unfinished and all(
            u is State.CANCELLED for u in unfinished
        ):
            state = State.CANCELLED
        return Report(state, results)


class Batch:
    """A batch in flight. Dropping it waits for it."""

    def __init__(self, native: _native.Batch):
        self._native = native

    def done(self) -> bool:
        """Whether every object has settled."""
        return self._native.done()

    def state(self, tag: int) -> _t.Optional[State]:
        """The state of the object tagged ``tag`` now; None if no object has that tag."""
        s = self._native.state(tag)
        return None if s is None else State(s)

    def report(self) -> Report:
        """Where every object stands now, without waiting."""
        return Report._from(self._native.report())

    @_t.overload
    def wait(self, timeout: None = None) -> Report: ...

    @_t.overload
    def wait(self, timeout: float) -> _t.Optional[Report]: ...

    def wait(self, timeout: _t.Optional[float] = None) -> _t.Optional[Report]:
        """Waits (GIL released) until every object settled; None if ``timeout`` seconds pass
        first (so never None without a timeout)."""
        raw = self._native.wait(timeout)
        return None if raw is None else Report._from(raw)

    def wait_group(self, group: int, timeout: _t.Optional[float] = None) -> bool:
        """Waits until layer groups ``0 ..= group`` settled (their bytes landed, or their
        objects failed); False if ``timeout`` seconds pass first. Per-object outcomes come
        from :meth:`state` or :meth:`wait`."""
        return self._native.wait_group(group, timeout)

    def wait_group_enqueued(self, group: int, timeout: _t.Optional[float] = None) -> bool:
        """For a batch started with a ``stream``: waits until layer groups ``0 ..= group`` are
        done or queued on that stream, so kernels you launch on the stream from now on run
        after their bytes landed, without waiting for the device here. False if ``timeout``
        seconds pass first. Without a stream it is :meth:`wait_group`. Failures show once the
        group settles (:meth:`wait_group`, :meth:`wait`)."""
        return self._native.wait_group_enqueued(group, timeout)

    def group_event(self, group: int, timeout: _t.Optional[float] = None) -> _t.Optional[int]:
        """For a batch started with a ``stream``: the raw event (``CUevent``) recorded on it
        once layer group ``group`` was enqueued, for another stream to wait on
        (``cudaStreamWaitEvent``); waits for it to be recorded, None if ``timeout`` passes.
        Valid while the batch object lives."""
        return self._native.group_event(group, timeout)

    def cancel(self) -> Report:
        """Skips what has not started, waits for what runs, and returns the report."""
        return Report._from(self._native.cancel())

    def __await__(self) -> _t.Generator[_t.Any, None, Report]:
        """``await batch`` in asyncio: the report once every object settled, with no thread
        waiting for it (the batch calls back, through the running loop's
        ``call_soon_threadsafe``, from the thread that finishes it)."""
        loop = _asyncio.get_running_loop()
        settled: _asyncio.Future[None] = loop.create_future()

        def done() -> None:  # on the thread that finished the batch
            loop.call_soon_threadsafe(_resolve, settled)

        self._native.call_when_done(done)
        yield from settled.__await__()
        return self.wait()


def _resolve(future: _asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


#: Struct codes of plain numbers and bytes (``struct`` and PEP 3118): any bytes written into
#: them are a valid value. ``O`` (a Python object), ``P`` / ``z`` / ``&`` (pointers) and text
#: (``u``, ``w``) are not: a transfer writing into those could crash the interpreter.
_PLAIN_CODES = frozenset("bBhHiIlLqQnNefdg?cspx")


def _plain_format(fmt: str) -> bool:
    """Whether a buffer of PEP 3118 format ``fmt`` holds only numbers and bytes, structured
    formats (``T{...}``) and sub-arrays included. Anything not understood is refused."""
    fmt = _re.sub(r":[^:]*:", "", fmt)  # the field names of a structured format
    fmt = _re.sub(r"\([0-9, ]*\)", "", fmt)  # sub-array shapes
    fmt = _re.sub(r"Z(?=[efdg])", "", fmt)  # complex numbers
    fmt = fmt.replace("T{", "").replace("}", "")
    return all(c in _PLAIN_CODES or c in "@=<>!^ " or c.isdigit() for c in fmt)


#: The integer and bool dtypes of torch (floating and complex ones are told by the dtype).
_TORCH_INTEGERS = frozenset(
    ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"]
)


def _check_tensor_dtype(tensor: _t.Any) -> None:
    """Refuses (``TypeError``) a tensor whose dtype is not plain numbers (quantized ones)."""
    dtype = tensor.dtype
    plain = getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False)
    if not plain and str(dtype).replace("torch.", "", 1) not in _TORCH_INTEGERS:
        raise TypeError(f"a {dtype} tensor does not register: only plain numbers and bytes")


def _host_address(buffer: _t.Any) -> _t.Tuple[int, int, _t.Any]:
    """The address, length and keep-alive of a writable host buffer or host tensor of plain
    numbers or bytes."""
    data_ptr = getattr(buffer, "data_ptr", None)
    if callable(data_ptr) and hasattr(buffer, "device"):  # torch.Tensor
        if getattr(buffer.device, "type", None) != "cpu":
            raise ValueError(f"a {buffer.device} tensor is not host memory (cpu and cuda register)")
        if not buffer.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        _check_tensor_dtype(buffer)
        return buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer
    try:
        view = memoryview(buffer)
    except TypeError as e:
        raise TypeError(f"{type(buffer).__name__} exposes no buffer to register") from e
    if not _plain_format(view.format):
        # Object arrays hold pointers to Python objects: bytes restored into them would be
        # dereferenced as objects.
        raise TypeError(
            f"a buffer of format {view.format!r} does not register: only plain numbers and bytes"
        )
    if view.readonly:
        raise ValueError("the buffer is read-only; transfers write into registered memory")
    if not view.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    nbytes = view.nbytes
    view = view.cast("B")
    # A ctypes array over the buffer holds its export: the memory cannot be freed or resized
    # while the registration keeps it.
    if not nbytes:
        return 0, 0, (view, buffer)
    held = (_ctypes.c_char * nbytes).from_buffer(view)
    return _ctypes.addressof(held), nbytes, (held, view, buffer)


@_dc.dataclass(frozen=True)
class RemoteRegion:
    """One region a memory node exports: register it with :meth:`Engine.register_remote`."""

    peer: int
    region: int
    name: str
    length: int
    writable: bool


@_dc.dataclass(frozen=True)
class Peer:
    """A memory node the remote tier is connected to."""

    id: int
    regions: _t.List[RemoteRegion]

    def region(self, name: str) -> RemoteRegion:
        """The region exported as ``name``."""
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)


class Server:
    """Exports host buffers (numpy arrays, ``bytearray``s, CPU tensors) to other nodes' remote
    tiers over UCX: what a memory node runs. ``regions`` maps a name to a buffer, or to
    ``(buffer, writable)`` (default writable). The server holds the buffers until closed, and
    closing stops serving first (clients then see the node go away).

    ``transports`` follows ``UCX_TLS`` (``"tcp"``, ``"rc,sm"``...). Clients must prove they hold
    ``secret`` (16 to 4096 bytes; ``None``: the ``UMBP_UCX_SECRET`` environment variable),
    which never travels; without one the server refuses to start unless ``insecure_no_auth``,
    which lets anyone who reaches the port read every region and write the writable ones.

    ``node``: the node id this server serves as in a pool (the id its regions are registered
    and announced under). It names it in every client's welcome, and a pool's clients refuse a
    memory node that names another id or none, so a node whose regions are pool tiers must
    give it; a client that connects by address (:meth:`Engine.connect`) does not check it.

    ``congestion``: the TCP congestion control of its connections, as an engine's
    ``remote_congestion``."""

    def __init__(
        self,
        regions: _t.Dict[str, _t.Any],
        listen: str = "127.0.0.1:0",
        *,
        transports: _t.Optional[str] = None,
        secret: _t.Optional[bytes] = None,
        insecure_no_auth: bool = False,
        node: _t.Optional[int] = None,
        congestion: str = "auto",
    ):
        exports = []
        for name, value in regions.items():
            buffer, writable = value if isinstance(value, tuple) else (value, True)
            address, nbytes, keep = _host_address(buffer)
            exports.append((name, address, nbytes, bool(writable), keep))
        self._native = _native.Server(
            listen, exports, transports, secret, insecure_no_auth, node, congestion
        )

    @property
    def address(self) -> str:
        """``"host:port"`` to pass to :meth:`Engine.connect`."""
        return self._native.address

    @property
    def clients(self) -> int:
        """Clients connected now: connections, so an engine counts once per lane (two by
        default: each engine reaches a node over two connections)."""
        return self._native.clients

    def close(self) -> None:
        """Stops serving, then lets go of the buffers."""
        self._native.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _file_size(path: _t.Any) -> _t.Optional[int]:
    """The size of the file (or block device) at ``path``; None if it does not exist. Raises
    :class:`RegistrationError` (with ``.errno``) if it cannot be inspected."""
    try:
        st = _os.stat(path)
        if not _stat.S_ISBLK(st.st_mode):
            return st.st_size
        fd = _os.open(path, _os.O_RDONLY)
        try:
            return _os.lseek(fd, 0, _os.SEEK_END)
        finally:
            _os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        err = RegistrationError(f"could not open {path}: {e.strerror}")
        err.errno = e.errno
        raise err from None


def _stream(stream: _t.Any, device: _t.Optional[int]) -> _t.Tuple[_t.Optional[int], int]:
    """The raw handle and device of a ``torch.cuda.Stream``, a raw int, or None."""
    if stream is None:
        return None, 0
    raw = getattr(stream, "cuda_stream", stream)
    if not isinstance(raw, int):
        raise TypeError("stream must be a torch.cuda.Stream or a raw stream handle (int)")
    if device is None:
        index = getattr(getattr(stream, "device", None), "index", None)
        device = index or 0
    return raw, device


class Engine:
    """Host copies, one device (a simulated GPU, or CUDA) and SSD files behind one composite.

    ``device="sim"`` keeps device memory in host memory (runs anywhere); ``"cuda"`` needs a
    build with the CUDA backend (:data:`CUDA`) and an NVIDIA GPU. Host memory registered here
    is pinned for ``pin_device`` so the gather kernel reads it directly. ``ssd_worker_cpus``
    pins the SSD engine's workers (worker ``i`` to the ``i``-th CPU, cycling): best on the CPUs
    that take the disk's completion interrupts (``/proc/interrupts``), away from the threads
    that feed the GPU; a CPU this process may not use raises :class:`Error`. ``bounce_bytes``
    sizes the host region that SSD <-> device transfers pass through, in 2 MiB stages: at most
    ``workers`` stages run at once, so ``workers`` x 2 MiB (the default 16 MiB) is all of it they
    use, and a small region also reads faster. A ``bounce_bytes`` past this machine's memory
    raises ``MemoryError``, more than 1024 ``workers`` ``ValueError``.

    ``remote=True`` adds the remote tier (UCX) over ``remote_transports``; it proves to memory
    nodes that it holds ``remote_secret`` (``None``: the ``UMBP_UCX_SECRET`` environment
    variable) and checks that they hold it too, or, with ``remote_insecure_no_auth``, connects
    to nodes that run without authentication. It reaches each node over ``remote_lanes``
    connections (default 2, at least 1, else ``ValueError``): the node serves each on a thread
    of its own, so more lanes put more of its cores on this engine's transfers.
    ``remote_congestion`` picks their TCP congestion control: ``"auto"`` (the default: the
    system's, except that a connection staying on this host leaves a pacing one such as BBR
    for ``"cubic"``), ``"system"`` (the system's everywhere) or an algorithm's name
    (``"cubic"``, ``"dctcp"``...) everywhere; a name that cannot be one raises ``ValueError``,
    one the kernel does not let this process pick :class:`Error`.

    ``checksums`` (a :class:`ChecksumPolicy` or its name): which tiers' objects get a CRC32C,
    reported by offloads (:attr:`ObjectResult.checksum`) and verified by restores given one
    (:attr:`Object.checksum`). The default, ``"files_and_remote"``, verifies loads from SSD and
    remote nodes; ``"all_tiers"`` adds DRAM (hashed while copied where the CPU copies, beside the
    copy where a GPU's DMA reads the pages: see the umbp-composite README for the measured
    cost); ``"off"`` hashes nothing. An unknown name raises
    ``ValueError``.

    :meth:`close` (or leaving a ``with Engine() as engine:`` block) waits for the batches it
    started and lets the engine go; every later call raises :class:`ClosedError`."""

    def __init__(
        self,
        device: str = "sim",
        *,
        sim_devices: int = 1,
        pin_device: _t.Optional[int] = 0,
        workers: int = 8,
        bounce_bytes: int = 16 << 20,
        ssd_queue_depth: int = 64,
        ssd_worker_cpus: _t.Optional[_t.Sequence[int]] = None,
        remote: bool = False,
        remote_transports: _t.Optional[str] = None,
        remote_secret: _t.Optional[bytes] = None,
        remote_insecure_no_auth: bool = False,
        remote_lanes: int = 2,
        remote_congestion: str = "auto",
        checksums: _t.Union["ChecksumPolicy", str] = "files_and_remote",
    ):
        # Guards _engine, _starting and _batches: a start counts itself in _starting while it
        # runs (outside the lock, so threads plan their batches side by side), and close()
        # waits for those, then for every batch they made that is still alive.
        self._state = _threading.Condition()
        self._starting = 0
        self._batches: "_weakref.WeakSet[Batch]" = _weakref.WeakSet()
        self._engine: _t.Optional[_NativeEngine] = _native.Engine(
            device=device,
            sim_devices=sim_devices,
            pin_device=pin_device,
            workers=workers,
            bounce_bytes=bounce_bytes,
            ssd_queue_depth=ssd_queue_depth,
            ssd_worker_cpus=None if ssd_worker_cpus is None else list(ssd_worker_cpus),
            remote=remote,
            remote_transports=remote_transports,
            remote_secret=remote_secret,
            remote_insecure_no_auth=remote_insecure_no_auth,
            remote_lanes=remote_lanes,
            remote_congestion=remote_congestion,
            checksums=str(ChecksumPolicy(checksums)),
        )

    @property
    def _native(self) -> _NativeEngine:
        """The native engine; :class:`ClosedError` once :meth:`close` began."""
        engine = self._engine
        if engine is None:
            raise ClosedError("the engine is closed")
        return engine

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._engine is None

    def close(self) -> None:
        """Closes the engine: from now on every call (starting a batch, registering, reading,
        :class:`~umbp.Pool` over it...) raises :class:`ClosedError`. The batches it started and
        that are still in flight are waited for (with the GIL released) before it returns, so
        their objects settle as they would have; their :class:`Batch` objects stay usable.
        Idempotent, and safe from any thread: a second call returns at once. The engine's
        threads and memory go once the registrations made by it are closed too (or
        garbage-collected)."""
        with self._state:
            if self._engine is None:
                return
            self._engine = None
            while self._starting:
                self._state.wait()
            batches = list(self._batches)
        for batch in batches:
            batch.wait()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self, address: str) -> "Peer":
        """Connects the remote tier (``Engine(remote=True)``) to a memory node serving at
        ``address`` (``"host:port"``, a :class:`Server` or ``umbp-bench serve``) and returns
        its regions. A node that dies later fails exactly the objects in flight to it."""
        peer, regions = self._native.connect(address)
        return Peer(peer, [RemoteRegion(peer, *r) for r in regions])

    def disconnect(self, peer: "Peer") -> None:
        """Retires a memory node: what is in flight to it finishes, later batches fail its
        objects at once. :meth:`connect` again when it is back."""
        self._native.disconnect(peer.id)

    def peer_alive(self, peer: "Peer") -> bool:
        """Whether the memory node ``peer`` is still connected: false once its process
        exited or its network went (its objects then fail at once), or after
        :meth:`disconnect`. A node that restarted is reached again with :meth:`connect`."""
        return self._native.peer_alive(peer.id)

    def register_remote(
        self,
        region: "RemoteRegion",
        offset: int = 0,
        length: _t.Optional[int] = None,
        *,
        label: _t.Optional[str] = None,
    ) -> Registration:
        """Registers bytes ``offset .. offset + length`` (default: to the end) of a peer's
        region, to use as an object's tier like a registered array or file. Refused past what
        the peer exported. Error messages call it by the region's name on its node
        (``"arena"``), or by ``label`` when given."""
        if length is None:
            length = region.length - offset
        return _labeled(
            self._native.register_remote(region.peer, region.region, offset, length),
            region.name if label is None else label,
        )

    @property
    def device_kind(self) -> str:
        """``"sim"`` or ``"cuda"``."""
        return self._native.device_kind

    def register(self, buffer: _t.Any, *, label: _t.Optional[str] = None) -> Registration:
        """Registers host memory (a numpy array, ``bytearray``, writable ``memoryview``, or a
        CPU torch tensor) or a CUDA torch tensor (as device memory). The registration keeps the
        buffer alive until closed; a tensor is kept, not locked, so do not resize it (or
        ``set_()`` its storage) while it is registered. Only plain numbers and bytes register:
        an object array, a structured array with an object field, or any buffer format but
        numbers and bytes raises ``TypeError`` (transfers write raw bytes into it).

        ``label``: what error messages call the region (``"kv-cache"`` instead of
        ``endpoint 4294967296``); :attr:`Registration.label` reads it back."""
        device: _t.Any = getattr(buffer, "device", None)
        if getattr(device, "type", None) == "cuda":
            if not buffer.is_contiguous():
                raise ValueError("the tensor must be contiguous")
            _check_tensor_dtype(buffer)
            nbytes = buffer.numel() * buffer.element_size()
            return _labeled(
                self._native.register_device(
                    device.index or 0, buffer.data_ptr(), nbytes, buffer
                ),
                label,
            )
        address, nbytes, keep = _host_address(buffer)
        return _labeled(self._native.register_host(address, nbytes, keep), label)

    def register_file(
        self,
        path: _t.Union[str, "_os.PathLike[str]"],
        offset: int = 0,
        length: _t.Optional[int] = None,
        *,
        direct: bool = True,
        writable: bool = True,
        create: bool = False,
        extend: bool = False,
        exclusive: bool = False,
        label: _t.Optional[str] = None,
    ) -> Registration:
        """Registers bytes ``offset .. offset + length`` of a file or block device (to its end
        by default), opened with ``O_DIRECT`` where the filesystem allows it. Error messages
        call it by its path, or by ``label`` when given. Raises
        :class:`RegistrationError` (with ``.errno``) if it cannot be opened, and for a
        read-only range past the end of the file (no transfer could read those bytes). A
        writable range may reach past the end (an offload tier may start empty; reading bytes
        no offload wrote fails as a short file) unless ``extend``, which sizes the file to the
        range's end at once (zeros, sparse).

        ``create``: a missing file is created (writable registrations only; with
        ``writable=False`` it raises :class:`RegistrationError` and creates nothing); without
        it a missing file raises :class:`RegistrationError` with ``errno == errno.ENOENT``.
        ``register_file(path, 0, n, create=True, extend=True)`` is a tier file of ``n`` bytes,
        new or left by a previous run. ``direct=False`` opens it without ``O_DIRECT``;
        ``writable=False`` read-only.

        ``exclusive``: the registration holds an exclusive lock on the file (``flock``) until
        it ends, so that no other instance uses it as its tier file; a file another process,
        engine or exclusive registration holds is refused at once with
        :class:`RegistrationError` (``errno == errno.EWOULDBLOCK``) saying so. Advisory: only
        exclusive registrations take or see it."""
        if length is None:
            size = _file_size(path)
            if size is None:  # missing: the native open raises the system's error
                size = offset
            if offset > size:
                raise ValueError(f"offset {offset} lies past the end of {path} ({size} bytes)")
            length = size - offset
        registration = self._native.register_file(
            _os.fspath(path),
            offset,
            length,
            direct=direct,
            writable=writable,
            create=create,
            extend=extend,
            exclusive=exclusive,
        )
        return _labeled(registration, label)

    def alloc_device(
        self, length: int, device: int = 0, *, label: _t.Optional[str] = None
    ) -> Registration:
        """Allocates ``length`` bytes of device memory, freed when the registration closes.
        ``label``: what error messages call it (``"kv-cache"`` instead of ``endpoint 3``), as
        for :meth:`register`."""
        return _labeled(self._native.alloc_device(length, device), label)

    def read(self, source: Registration, offset: int, length: int) -> bytes:
        """Copies bytes of any registered endpoint (device memory, a file) out to Python.
        Raises what a failed object of a batch carries (:class:`TransferError` with ``.errno``
        for a failed read...), :class:`ClosedError` if ``source`` was closed before or during
        the call, ``ValueError`` for bytes past the registration's end and ``MemoryError`` for
        more than this machine could hold, both before anything is allocated."""
        return self._native.read(source, offset, length)

    def write(self, target: Registration, offset: int, data: bytes) -> None:
        """Copies ``data`` into any registered endpoint at ``offset``; raises as :meth:`read`."""
        self._native.write(target, offset, bytes(data))

    def start_restore(
        self,
        objects: _t.Sequence[Object],
        timeout: _t.Optional[float] = None,
        stream: _t.Any = None,
        device: _t.Optional[int] = None,
    ) -> Batch:
        """Starts restoring ``objects`` (their ranges, from the tier into your endpoints) and
        returns the batch at once. ``timeout``: a deadline in seconds after which what has not
        arrived fails.

        ``stream``: a ``torch.cuda.Stream`` (or a raw ``CUstream`` as an int, on ``device``):
        the device work is queued on it, ordered with your kernels there, and
        :meth:`Batch.wait_group_enqueued` and :meth:`Batch.group_event` give per-layer
        readiness without waiting for the device. The stream must outlive the batch."""
        return self._start(objects, True, timeout, stream, device)

    def start_offload(
        self,
        objects: _t.Sequence[Object],
        timeout: _t.Optional[float] = None,
        stream: _t.Any = None,
        device: _t.Optional[int] = None,
    ) -> Batch:
        """Starts offloading ``objects``: their ranges from your endpoints into the tier's
        pages (bytes of an object no range names keep what they held). ``stream``: as for
        :meth:`start_restore` (reads of device memory then follow your kernels queued there
        before)."""
        return self._start(objects, False, timeout, stream, device)

    def _start(
        self,
        objects: _t.Sequence[Object],
        restore: bool,
        timeout: _t.Optional[float],
        stream: _t.Any,
        device: _t.Optional[int],
    ) -> Batch:
        raw, on = _stream(stream, device)
        native = [o._native() for o in objects]
        sums = [o.checksum for o in objects]
        checksums = None if all(c is None for c in sums) else sums
        with self._state:
            engine = self._native  # ClosedError once close() began
            self._starting += 1
        try:
            batch = Batch(engine.start(native, restore, timeout, raw, on, checksums))
            with self._state:
                self._batches.add(batch)
            return batch
        finally:
            with self._state:
                self._starting -= 1
                self._state.notify_all()

    def restore(self, objects: _t.Sequence[Object], timeout: _t.Optional[float] = None) -> Report:
        """:meth:`start_restore`, then waits; one result per object (``timeout`` is the
        batch's deadline: what has not arrived by then fails, the report still comes)."""
        return self.start_restore(objects, timeout).wait()

    def offload(self, objects: _t.Sequence[Object], timeout: _t.Optional[float] = None) -> Report:
        """:meth:`start_offload`, then waits."""
        return self.start_offload(objects, timeout).wait()

    def metrics(self) -> Metrics:
        """Counters per ``(engine, direction)`` under ``"engines"``, and what is in flight
        under ``"in_flight"``: ``m["engines"][("ssd", "host->file")]["bytes"]``,
        ``m["in_flight"]["batches"]``."""
        return _t.cast(Metrics, self._native.metrics())

    def metrics_text(self) -> str:
        """Every metric of the engine in the Prometheus text format, for a scraper: bytes,
        objects and failures per engine and direction, latency histograms and in-flight
        gauges (``docs/OBSERVABILITY.md`` lists them)."""
        return self._native.metrics_text()
