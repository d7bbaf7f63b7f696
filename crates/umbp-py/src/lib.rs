//! `umbp._native`: the Rust half of the `umbp` Python package.
//!
//! The public API is the pure-Python `umbp` package around this module (`python/umbp`): it
//! turns numpy arrays, `bytearray`s, memoryviews and torch tensors into the addresses this
//! module registers, holding the buffer export (or the tensor) for as long as the registration
//! lives, so no transfer ever writes into freed memory. This module owns the engines: a
//! composite of the host copy engine, the device engine (the simulated device, or CUDA when
//! built with it) and the SSD engine, with a bounce region for SSD ↔ device. The GIL is
//! released while batches are planned and while anything waits.
//!
//! `Engine.register_host` and `Engine.register_device` take raw addresses and are private to
//! the package (their callers promise the memory stays valid while registered): Python has no
//! `unsafe`, so the promise lives in `umbp/__init__.py`, which only passes addresses of
//! buffers it keeps exported.
#![allow(unsafe_code)] // Registering raw addresses the Python layer vouches for.

mod pool;

use std::fs::File;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use umbp_composite::{
    start_offload, start_restore, Batch as CompositeBatch, ChecksumPolicy, CompositeConfig,
    CompositeEngine, EndpointNames, ObjectError, ObjectRange, ObjectTransfer, PagedObject, Staging,
    TransferReport,
};
use umbp_hbm::{HbmConfig, HbmEngine, LayerEvents, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    AlignedBuffer, BatchState, DeviceOrdinal, DeviceStream, Endpoint, EndpointId, EndpointRegistry,
    FailureCause, FileOptions, FileSource, Fragment, GroupListener, ObjectState, Register,
    RegisterError, Registration as Guard, RejectReason, Tag, TransferEngine,
};
use umbp_remote::{Congestion, RemoteConfig, RemoteEngine, RemoteServer, ServerBuilder};
use umbp_ssd::{SsdConfig, SsdEngine};

create_exception!(_native, Error, PyException, "Every umbp error derives from this.");
create_exception!(_native, RegistrationError, Error, "Memory or a file could not be registered.");
create_exception!(
    _native,
    RejectedError,
    Error,
    "An object was refused while planning; no byte of it moved."
);
create_exception!(_native, TransferError, Error, "A transfer carrying an object's bytes failed.");
create_exception!(
    _native,
    ClosedError,
    Error,
    "The registration (or the engine) is closed, or was closed while the call used it."
);
create_exception!(
    _native,
    CancelledError,
    Error,
    "The batch was cancelled before all of the object's bytes arrived."
);
create_exception!(
    _native,
    DuplicateTagError,
    Error,
    "Two objects of one batch carry the same tag (`.tag`); nothing of the batch was started."
);

/// The most executor threads an [`Engine`] starts (`workers`).
const MAX_WORKERS: usize = 1024;

/// The device engine, over whichever runtime this engine drives.
enum Device {
    Sim(Arc<HbmEngine<SimDevice>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<HbmEngine<umbp_hbm::CudaRuntime>>),
}

impl Device {
    fn alloc(&self, device: DeviceOrdinal, len: u64) -> Result<Guard, umbp_hbm::Error> {
        match self {
            Device::Sim(e) => e.alloc_device(device, len),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.alloc_device(device, len),
        }
    }

    fn engine(&self) -> Arc<dyn TransferEngine> {
        match self {
            Device::Sim(e) => e.clone(),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => e.clone(),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Device::Sim(_) => "sim",
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => "cuda",
        }
    }

    fn layer_events(&self, stream: DeviceStream) -> Events {
        match self {
            Device::Sim(e) => Events::Sim(e.layer_events(stream)),
            #[cfg(feature = "cuda")]
            Device::Cuda(e) => Events::Cuda(e.layer_events(stream)),
        }
    }
}

/// One event per layer group of a batch on a caller's stream, over whichever runtime.
enum Events {
    Sim(Arc<LayerEvents<SimDevice>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<LayerEvents<umbp_hbm::CudaRuntime>>),
}

impl Events {
    fn listener(&self) -> Arc<dyn GroupListener> {
        match self {
            Events::Sim(e) => e.clone(),
            #[cfg(feature = "cuda")]
            Events::Cuda(e) => e.clone(),
        }
    }

    fn event(
        &self,
        group: u32,
        timeout: Option<Duration>,
    ) -> Result<Option<u64>, umbp_hbm::DeviceError> {
        match self {
            Events::Sim(e) => e.event(group, timeout),
            #[cfg(feature = "cuda")]
            Events::Cuda(e) => e.event(group, timeout),
        }
    }
}

/// A composite over host copies, one device engine, the SSD engine and, when asked for, the
/// remote (UCX) engine.
#[pyclass(module = "umbp._native", frozen)]
struct Engine {
    /// `None` only while being dropped.
    composite: Option<Arc<CompositeEngine>>,
    /// `None` only while being dropped.
    device: Option<Device>,
    remote: Option<Arc<RemoteEngine>>,
    /// The region the staged route passes through; `None` only while being dropped.
    bounce: Option<Guard<AlignedBuffer>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let parts =
            (self.composite.take(), self.bounce.take(), self.remote.take(), self.device.take());
        // Dropping the composite waits for the batches in flight, which may take as long as
        // their deadlines (or a dead peer's), and dropping an engine joins its threads, which
        // may be logging (each record taken to Python's `logging` takes the GIL): never with
        // the GIL held, or a thread logging as the engine goes waits for it forever.
        Python::with_gil(|py| py.allow_threads(move || drop(parts)));
    }
}

fn registration_error(e: RegisterError) -> PyErr {
    let errno = match &e {
        RegisterError::Open { source, .. }
        | RegisterError::Inspect { source, .. }
        | RegisterError::Extend { source, .. }
        | RegisterError::Locked { source, .. } => source.raw_os_error(),
        _ => None,
    };
    let err = RegistrationError::new_err(message(&e));
    Python::with_gil(|py| {
        let _ = err.value(py).setattr("errno", errno);
    });
    err
}

/// A batch that could not start: a repeated tag is a [`DuplicateTagError`] whose `.tag` is
/// that tag, anything else an [`Error`].
fn start_error(e: umbp_composite::Error) -> PyErr {
    match e {
        umbp_composite::Error::DuplicateTag(tag) => {
            let err = DuplicateTagError::new_err(message(&e));
            Python::with_gil(|py| {
                let _ = err.value(py).setattr("tag", tag);
            });
            err
        }
        e => error(e),
    }
}

fn error(e: impl std::error::Error + 'static) -> PyErr {
    Error::new_err(message(&e))
}

/// A timeout in seconds from Python: `None`, an infinite one or one past what a clock can add
/// means no limit (`None`); a negative one is zero; NaN is a `ValueError`.
fn timeout_of(seconds: Option<f64>) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_nan() => Err(PyValueError::new_err("a timeout cannot be NaN")),
        Some(s) => Ok(Duration::try_from_secs_f64(s.max(0.0)).ok()),
    }
}

/// An error's words, then its causes' (its `source()` chain), as one message: a Rust error's
/// `Display` gives only its own words, and Python shows one string.
fn message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

impl Engine {
    /// The engines of an [`Engine`], its arguments checked: `Engine.__init__` without the GIL.
    #[allow(clippy::too_many_arguments)] // Engine.__init__'s keyword arguments.
    fn start_engines(
        device: &str,
        sim_devices: u32,
        pin_device: Option<u32>,
        workers: usize,
        bounce_bytes: usize,
        ssd_queue_depth: u32,
        ssd_worker_cpus: Option<Vec<usize>>,
        remote: Option<RemoteConfig>,
        checksums: ChecksumPolicy,
    ) -> PyResult<Self> {
        let registry = EndpointRegistry::new();
        let config = HbmConfig {
            pin_registered_host: pin_device.map(DeviceOrdinal::new),
            ..HbmConfig::default()
        };
        let device = match device {
            "sim" => {
                let runtime = Arc::new(SimDevice::new(sim_devices.max(1)));
                Device::Sim(Arc::new(HbmEngine::new(runtime, registry.clone(), config)))
            }
            #[cfg(feature = "cuda")]
            "cuda" => {
                let runtime = umbp_hbm::CudaRuntime::new().map_err(error)?;
                let config = HbmConfig { calibrate: true, ..config };
                Device::Cuda(Arc::new(HbmEngine::new(Arc::new(runtime), registry.clone(), config)))
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown device `{other}` (this build has: {})",
                    if cfg!(feature = "cuda") { "sim, cuda" } else { "sim" }
                )))
            }
        };
        let host = Arc::new(LocalCopyEngine::new(registry.clone()));
        let ssd_config = SsdConfig {
            queue_depth: ssd_queue_depth,
            worker_cpus: ssd_worker_cpus.unwrap_or_default(),
            ..SsdConfig::default()
        };
        let ssd = SsdEngine::new(registry.clone(), ssd_config).map_err(error)?;
        let mut engines: Vec<Arc<dyn TransferEngine>> = vec![host, device.engine(), Arc::new(ssd)];
        let remote = match remote {
            Some(config) => {
                let ucx = Arc::new(RemoteEngine::new(registry.clone(), config).map_err(error)?);
                engines.push(ucx.clone());
                Some(ucx)
            }
            None => None,
        };
        let composite = CompositeEngine::with_config(
            registry,
            engines,
            CompositeConfig { workers, checksums, ..CompositeConfig::default() },
        );
        let bounce = composite
            .register_memory(AlignedBuffer::for_direct_io(bounce_bytes))
            .map_err(registration_error)?;
        composite.set_staging(Staging::new(bounce.id())).map_err(error)?;
        Ok(Self {
            composite: Some(Arc::new(composite)),
            device: Some(device),
            remote,
            bounce: Some(bounce),
        })
    }
}

#[pymethods]
impl Engine {
    /// `device`: `"sim"` (a simulated GPU in host memory) or `"cuda"` (needs a build with the
    /// `cuda` feature and an NVIDIA GPU). `pin_device`: the device host memory registered
    /// through this engine is pinned for, so the gather kernel reads it directly.
    #[new]
    ///
    /// `remote`: also run the remote engine (UCX), over `remote_transports` (UCX_TLS's syntax;
    /// `None`: UCX's choice), authenticating memory nodes with the shared secret
    /// `remote_secret` (`None`: `UMBP_UCX_SECRET` from the environment), or connecting to
    /// nodes that run without authentication when `remote_insecure_no_auth`, over
    /// `remote_lanes` connections to each node (at least 1; each is served by a thread of its
    /// own on the node, so more lanes put more cores on one node's transfers), under the TCP
    /// congestion control `remote_congestion` (`"auto"`, `"system"` or an algorithm's name:
    /// `umbp_remote::Congestion`). `ssd_worker_cpus`: the CPUs the SSD engine's workers are pinned
    /// to, worker `i` to the `i`-th (cycling); `None`: not pinned. A `bounce_bytes` past this
    /// machine's memory raises `MemoryError`, more than 1024 `workers` `ValueError`, before
    /// anything is allocated or started. `checksums`: which tiers' objects get a CRC32C
    /// (`"off"`, `"files_and_remote"`, `"all_tiers"`; `umbp_composite::ChecksumPolicy`):
    /// offloads report it, restores given one verify it.
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    #[pyo3(signature = (*, device="sim", sim_devices=1, pin_device=Some(0), workers=8, bounce_bytes=16 << 20, ssd_queue_depth=64, ssd_worker_cpus=None, remote=false, remote_transports=None, remote_secret=None, remote_insecure_no_auth=false, remote_lanes=2, remote_congestion="auto", checksums="files_and_remote"))]
    fn new(
        py: Python<'_>,
        device: &str,
        sim_devices: u32,
        pin_device: Option<u32>,
        workers: usize,
        bounce_bytes: u64,
        ssd_queue_depth: u32,
        ssd_worker_cpus: Option<Vec<usize>>,
        remote: bool,
        remote_transports: Option<String>,
        remote_secret: Option<Vec<u8>>,
        remote_insecure_no_auth: bool,
        remote_lanes: usize,
        remote_congestion: &str,
        checksums: &str,
    ) -> PyResult<Self> {
        let checksums = ChecksumPolicy::from_name(checksums).ok_or_else(|| {
            PyValueError::new_err(format!(
                "checksums={checksums:?}: one of \"off\", \"files_and_remote\", \"all_tiers\""
            ))
        })?;
        // Checked before anything starts: the bounce region is allocated whole (an allocation
        // the system refuses aborts), and each worker is a thread.
        let bounce_bytes = host_len(bounce_bytes, "a bounce region")?.max(2);
        if remote_lanes == 0 {
            return Err(PyValueError::new_err("remote_lanes=0: at least one connection a node"));
        }
        let remote_congestion = congestion(remote_congestion, "remote_congestion")?;
        if workers > MAX_WORKERS {
            return Err(PyValueError::new_err(format!(
                "workers={workers}: at most {MAX_WORKERS} executor threads"
            )));
        }
        // Started with the GIL released: the engines' threads may log (which takes the GIL)
        // while this thread waits for them.
        py.allow_threads(|| {
            Self::start_engines(
                device,
                sim_devices,
                pin_device,
                workers,
                bounce_bytes,
                ssd_queue_depth,
                ssd_worker_cpus,
                remote.then(|| {
                    let mut config = ucx_config(
                        remote_transports,
                        remote_secret,
                        remote_insecure_no_auth,
                        remote_congestion,
                    );
                    config.lanes = remote_lanes;
                    config
                }),
                checksums,
            )
        })
    }

    /// Connects the remote engine to the memory node serving at `addr`: its peer number and
    /// regions as `(region, name, length, writable)`.
    fn connect(&self, py: Python<'_>, addr: String) -> PyResult<(u32, Vec<RegionTuple>)> {
        let remote = self.remote()?;
        let peer = py.allow_threads(|| remote.connect(addr.as_str())).map_err(error)?;
        let regions =
            peer.regions.iter().map(|r| (r.region.region, r.name.clone(), r.len, r.writable));
        Ok((peer.id, regions.collect()))
    }

    /// Retires peer `peer` after what is in flight to it; its objects fail from then on.
    fn disconnect(&self, py: Python<'_>, peer: u32) -> PyResult<()> {
        let remote = self.remote()?;
        py.allow_threads(|| remote.disconnect(peer)).map_err(error)
    }

    /// Whether peer `peer` is connected and alive: false once its process exited or its
    /// network went (the remote engine noticed its control connection end), or after
    /// `disconnect`.
    fn peer_alive(&self, peer: u32) -> PyResult<bool> {
        Ok(self.remote()?.is_alive(peer))
    }

    /// Registers bytes `offset .. offset + length` of region `region` of peer `peer`.
    fn register_remote(
        &self,
        py: Python<'_>,
        peer: u32,
        region: u32,
        offset: u64,
        length: u64,
    ) -> PyResult<Registration> {
        self.remote()?;
        let region = umbp_plan::RemoteRegion { peer, region };
        let composite = self.composite();
        let guard = py
            .allow_threads(|| composite.register_remote(region, offset, length))
            .map_err(registration_error)?;
        Ok(self.registration(Kept::Memory(guard), None, "remote"))
    }

    /// The device runtime: `"sim"` or `"cuda"`.
    #[getter]
    fn device_kind(&self) -> &'static str {
        self.device().name()
    }

    /// Registers `length` bytes of host memory at `addr`; `owner` is kept until the
    /// registration ends. Private: the caller promises the memory stays valid meanwhile.
    fn register_host(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        owner: PyObject,
    ) -> PyResult<Registration> {
        let composite = self.composite();
        // SAFETY: the package's Python layer passes the address of a buffer it holds exported
        // in `owner`, which the registration keeps until it has ended (and so until no batch
        // uses it).
        let guard = py
            .allow_threads(|| unsafe {
                composite.register_raw_memory(Endpoint::host(addr, length))
            })
            .map_err(registration_error)?;
        Ok(self.registration(Kept::Memory(guard), Some(owner), "host"))
    }

    /// Registers `length` bytes of device memory at `addr` on `device`; as `register_host`.
    fn register_device(
        &self,
        py: Python<'_>,
        device: u32,
        addr: u64,
        length: u64,
        owner: PyObject,
    ) -> PyResult<Registration> {
        let endpoint = Endpoint::device(DeviceOrdinal::new(device), addr, length);
        let composite = self.composite();
        // SAFETY: as in `register_host`: `owner` (a tensor) keeps the memory allocated.
        let guard = py
            .allow_threads(|| unsafe { composite.register_raw_memory(endpoint) })
            .map_err(registration_error)?;
        Ok(self.registration(Kept::Memory(guard), Some(owner), "device"))
    }

    /// Registers bytes `offset .. offset + length` of the file at `path`; with `extend`, a
    /// shorter file is first sized to the range's end. A read-only range past the end of the
    /// file is a `RegistrationError`. With `exclusive`, the registration holds the file's
    /// exclusive lock for its life; a file another process or instance holds so is a
    /// `RegistrationError` with `errno` `EWOULDBLOCK`.
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    #[pyo3(signature = (path, offset, length, *, direct=true, writable=true, create=false, extend=false, exclusive=false))]
    fn register_file(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        offset: u64,
        length: u64,
        direct: bool,
        writable: bool,
        create: bool,
        extend: bool,
        exclusive: bool,
    ) -> PyResult<Registration> {
        let options = FileOptions::new()
            .direct(direct)
            .writable(writable)
            .create(create)
            .extend(extend)
            .exclusive(exclusive);
        let composite = Arc::clone(self.composite());
        let guard = py
            .allow_threads(move || {
                composite.register_file(FileSource::open(path, options), offset, length)
            })
            .map_err(registration_error)?;
        Ok(self.registration(Kept::File(guard), None, "file"))
    }

    /// Allocates `length` bytes on `device`, freed when the registration ends.
    #[pyo3(signature = (length, device=0))]
    fn alloc_device(&self, py: Python<'_>, length: u64, device: u32) -> PyResult<Registration> {
        let guard = py
            .allow_threads(|| self.device().alloc(DeviceOrdinal::new(device), length))
            .map_err(error)?;
        Ok(self.registration(Kept::Memory(guard), None, "device"))
    }

    /// Bytes `offset .. offset + length` of a registered endpoint, copied out through the
    /// engines (device memory included).
    /// Raises what a failed object raises in a report ([`TransferError`] with its errno, a
    /// [`RejectedError`]...); a range past the registration's end is a `ValueError`, raised
    /// before anything is allocated.
    fn read(
        &self,
        py: Python<'_>,
        source: &Registration,
        offset: u64,
        length: u64,
    ) -> PyResult<Py<PyBytes>> {
        let id = self.endpoint(source)?;
        source.check_range(offset, length)?;
        let len = host_len(length, "a read")?;
        let composite = Arc::clone(self.composite());
        let bytes = py.allow_threads(move || -> Result<Vec<u8>, OneError> {
            let mut out = Vec::new();
            out.try_reserve_exact(len).map_err(|_| OneError::NoMemory(length))?;
            out.resize(len, 0);
            let out = composite.register_memory(out).map_err(OneError::other)?;
            let f = Fragment::new(id, offset, out.id(), 0, length, Tag::new(0));
            run_one(&composite, f)?;
            Ok(out.deregister())
        });
        let bytes = bytes.map_err(|e| e.into_py_err(py, id))?;
        Ok(PyBytes::new(py, &bytes).unbind())
    }

    /// Writes `data` into a registered endpoint at `offset`, through the engines; raises as
    /// `read` does.
    fn write(
        &self,
        py: Python<'_>,
        target: &Registration,
        offset: u64,
        data: Vec<u8>,
    ) -> PyResult<()> {
        let id = self.endpoint(target)?;
        target.check_range(offset, data.len() as u64)?;
        let composite = Arc::clone(self.composite());
        py.allow_threads(move || -> Result<(), OneError> {
            let len = data.len() as u64;
            let src = composite.register_memory(data).map_err(OneError::other)?;
            run_one(&composite, Fragment::new(src.id(), 0, id, offset, len, Tag::new(0)))
        })
        .map_err(|e| e.into_py_err(py, id))
    }

    /// Starts restoring (`restore=True`) or offloading `objects` and returns the batch at once.
    /// Each object is `(tag, tier, page_offsets_u64_le, page_size, size, ranges)`, each range
    /// `(offset, length, endpoint, endpoint_offset, group)`; `tier` and `endpoint` are
    /// registrations of this engine or raw endpoint ids. With `stream` (a raw stream handle of
    /// device `stream_device`), device work is queued on that stream and one event per layer
    /// group is recorded there. `checksums`: one per object, the CRC32C a restore must find
    /// (`None`: nothing to verify); offloads ignore them.
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    #[pyo3(signature = (objects, restore, timeout=None, stream=None, stream_device=0, checksums=None))]
    fn start(
        &self,
        py: Python<'_>,
        objects: Vec<ObjectTuple<'_>>,
        restore: bool,
        timeout: Option<f64>,
        stream: Option<u64>,
        stream_device: u32,
        checksums: Option<Vec<Option<u32>>>,
    ) -> PyResult<Batch> {
        if checksums.as_ref().is_some_and(|c| c.len() != objects.len()) {
            return Err(PyValueError::new_err("checksums: one per object"));
        }
        let specs: Vec<Spec> = objects
            .into_iter()
            .map(|(tag, tier, pages, page_size, size, ranges)| {
                if pages.len() % 8 != 0 {
                    return Err(PyValueError::new_err("page offsets must be u64 values"));
                }
                let pages = pages
                    .chunks_exact(8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect();
                let ranges = ranges
                    .into_iter()
                    .map(|(offset, len, endpoint, at, group)| {
                        let endpoint = self.named(&endpoint)?;
                        Ok(ObjectRange::new(offset, len, endpoint, at).in_group(group))
                    })
                    .collect::<PyResult<_>>()?;
                Ok(Spec { tag, tier: self.named(&tier)?, pages, page_size, size, ranges })
            })
            .collect::<PyResult<_>>()?;
        let composite = Arc::clone(self.composite());
        let deadline = timeout_of(timeout)?.and_then(|t| Instant::now().checked_add(t));
        // SAFETY: the Python layer documents the promise (a live stream of that device, kept
        // until the batch settles), as a raw handle from torch is all Python can give.
        let stream =
            stream.map(|raw| unsafe { DeviceStream::new(DeviceOrdinal::new(stream_device), raw) });
        let events = stream.map(|s| self.device().layer_events(s));
        let listener = events.as_ref().map(Events::listener);
        let batch = py.allow_threads(move || {
            let transfers: Vec<ObjectTransfer<'_>> = specs
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let object = PagedObject::new(s.tier, &s.pages, s.page_size, s.size);
                    let transfer = ObjectTransfer::new(s.tag, object, &s.ranges);
                    match checksums.as_ref().and_then(|c| c[i]) {
                        Some(checksum) => transfer.with_checksum(checksum),
                        None => transfer,
                    }
                })
                .collect();
            let mut builder = composite.builder();
            builder.set_deadline(deadline);
            builder.set_stream(stream);
            if let Some(listener) = listener {
                builder.set_group_listener(listener);
            }
            if restore {
                start_restore(&mut builder, &transfers)
            } else {
                start_offload(&mut builder, &transfers)
            }
        });
        Ok(Batch { batch: Some(batch.map_err(start_error)?), events })
    }

    /// One shape: `{"engines": {(engine, direction): counters}, "in_flight": {"batches",
    /// "bytes"}, "checksums": {"mismatches", "bytes"}}`; `umbp.Metrics` types it.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engines = PyDict::new(py);
        let composite = self.composite();
        let (snapshot, flight) =
            py.allow_threads(|| (composite.metrics_snapshot(), composite.in_flight()));
        for ((engine, direction), c) in snapshot {
            let d = PyDict::new(py);
            d.set_item("segments", c.segments)?;
            d.set_item("bytes", c.bytes)?;
            d.set_item("objects", c.objects)?;
            d.set_item("failures", c.failures)?;
            d.set_item("rejected_objects", c.rejected_objects)?;
            engines.set_item((engine.to_string(), direction.to_string()), d)?;
        }
        let checksums = PyDict::new(py);
        checksums.set_item("mismatches", composite.metrics().checksum_mismatches())?;
        checksums.set_item("bytes", composite.metrics().checksum_bytes())?;
        let in_flight = PyDict::new(py);
        in_flight.set_item("batches", flight.batches)?;
        in_flight.set_item("bytes", flight.bytes)?;
        let out = PyDict::new(py);
        out.set_item("engines", engines)?;
        out.set_item("in_flight", in_flight)?;
        out.set_item("checksums", checksums)?;
        Ok(out)
    }

    /// Every metric of the composite in the Prometheus text format.
    fn metrics_text(&self, py: Python<'_>) -> String {
        let composite = self.composite();
        py.allow_threads(|| composite.metrics_text())
    }
}

/// An object as Python hands it over: `(tag, tier, page_offsets_u64_le, page_size, size,
/// ranges)`, each range `(offset, length, endpoint, endpoint_offset, group)`.
type ObjectTuple<'py> =
    (u64, EndpointArg<'py>, Vec<u8>, u64, u64, Vec<(u64, u64, EndpointArg<'py>, u64, u32)>);

/// An endpoint as Python names it: a registration, or a raw endpoint id.
#[derive(FromPyObject)]
enum EndpointArg<'py> {
    Registration(Bound<'py, Registration>),
    Raw(u64),
}

/// A report as Python receives it: the aggregate, then `(tag, state, error or None, checksum
/// or None)` per object.
type ReportTuple = (&'static str, Vec<(u64, &'static str, Option<PyObject>, Option<u32>)>);

/// One object of a batch, owned while it is planned.
struct Spec {
    tag: u64,
    tier: EndpointId,
    pages: Vec<u64>,
    page_size: u64,
    size: u64,
    ranges: Vec<ObjectRange>,
}

/// Why a one-fragment transfer (`Engine.read`, `Engine.write`) failed.
enum OneError {
    /// The object's own error, raised as in a report.
    Object(ObjectError),
    /// The buffer of a read (this many bytes) could not be allocated.
    NoMemory(u64),
    /// Anything else (registering the bounce of the copy, planning, submitting).
    Other(String),
}

impl OneError {
    fn other(e: impl std::error::Error + 'static) -> Self {
        OneError::Other(message(&e))
    }

    /// The exception of a read or write of the registration that named `id`: the object's
    /// error as a report carries it, but [`ClosedError`] when the registration ended while
    /// the call used it (a close racing it), however far the transfer had come.
    fn into_py_err(self, py: Python<'_>, id: EndpointId) -> PyErr {
        match self {
            OneError::Object(e) if gone(&e) == Some(id) => {
                ClosedError::new_err(format!("registration {} was closed", id.raw()))
            }
            OneError::Object(e) => match object_error(py, &e, None) {
                Ok(value) => PyErr::from_value(value.into_bound(py)),
                Err(e) => e,
            },
            OneError::NoMemory(len) => {
                PyMemoryError::new_err(format!("could not allocate {len} bytes to read into"))
            }
            OneError::Other(text) => Error::new_err(text),
        }
    }
}

/// The endpoint whose deregistration failed an object, if that is why it failed: refused
/// while planning as unknown, or failed in flight as gone.
fn gone(e: &ObjectError) -> Option<EndpointId> {
    match e {
        ObjectError::Rejected(
            umbp_plan::Error::Rejected { reason: RejectReason::UnknownEndpoint(id), .. },
            _,
        )
        | ObjectError::Failed { cause: FailureCause::EndpointGone(id), .. } => Some(*id),
        _ => None,
    }
}

/// `len` bytes of host memory to allocate for Python, as a `usize`, if this machine could
/// hold them: past its physical memory it is a `MemoryError`, raised before anything is
/// allocated (an allocation the system refuses would abort the process).
fn host_len(len: u64, what: &str) -> PyResult<usize> {
    let limit = physical_memory().min(isize::MAX as u64);
    match usize::try_from(len) {
        Ok(n) if len <= limit => Ok(n),
        _ => Err(PyMemoryError::new_err(format!(
            "{what} of {len} bytes exceeds this machine's {limit} bytes of memory"
        ))),
    }
}

/// This machine's physical memory in bytes (`MemTotal` in `/proc/meminfo`), read once;
/// `u64::MAX` where it cannot be read.
fn physical_memory() -> u64 {
    static TOTAL: OnceLock<u64> = OnceLock::new();
    *TOTAL.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = info
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()));
        kib.and_then(|k| k.checked_mul(1024)).unwrap_or(u64::MAX)
    })
}

/// Moves one fragment as one object and waits for it.
fn run_one(composite: &CompositeEngine, f: Fragment) -> Result<(), OneError> {
    let mut builder = composite.builder();
    // A probe of the caller's bytes, not traffic: it stays out of the metrics.
    builder.set_metered(false);
    let plan = (|| {
        builder.begin_object(Tag::new(0))?;
        builder.push(f)?;
        builder.commit_object()?;
        builder.finish()
    })();
    let plans = match plan {
        Ok(plans) => plans,
        // A refused fragment is the object's rejection, as a batch would report it.
        Err(e @ umbp_plan::Error::Rejected { .. }) => {
            let names = EndpointNames::lookup(composite.registry(), [f.src, f.dst]);
            return Err(OneError::Object(ObjectError::Rejected(e, names)));
        }
        Err(e) => return Err(OneError::other(e)),
    };
    let submitted = composite.submit(plans).map_err(OneError::other)?;
    let report = submitted.wait();
    match report.objects.first().and_then(|o| o.error.clone()) {
        Some(e) => Err(OneError::Object(e)),
        None => Ok(()),
    }
}

/// What a registration keeps.
enum Kept {
    Memory(Guard),
    File(Guard<File>),
}

impl Kept {
    fn id(&self) -> EndpointId {
        match self {
            Kept::Memory(g) => g.id(),
            Kept::File(g) => g.id(),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Kept::Memory(g) => g.endpoint().len(),
            Kept::File(g) => g.endpoint().len(),
        }
    }
}

/// A registered endpoint. Closing it (or its garbage collection) deregisters it once no batch
/// uses it, then lets go of what kept the memory alive. Any thread may use or close it at any
/// time: its state sits behind locks held only for a moment, never while waiting.
#[pyclass(module = "umbp._native", frozen)]
struct Registration {
    state: Mutex<State>,
    /// Signalled when a close's deregistration has ended ([`State::Closed`]).
    ended: Condvar,
    owner: Mutex<Option<PyObject>>,
    /// The registry of the engine it was made by, whose ids it names.
    registry: Arc<EndpointRegistry>,
    kind: &'static str,
    id: u64,
    length: u64,
}

/// Where a [`Registration`] stands.
enum State {
    /// Registered, keeping what backs it.
    Open(Kept),
    /// A close is deregistering it: waiting for the batches that use it, then releasing what
    /// engines hold for it. The memory may still be written meanwhile.
    Closing,
    /// Deregistered: no batch uses it or ever will.
    Closed,
}

/// Marks a registration [`State::Closed`] and wakes every close waiting for it when dropped,
/// so a deregistration that unwinds still releases the other closers.
struct MarkClosed<'a>(&'a Registration);

impl Drop for MarkClosed<'_> {
    fn drop(&mut self) {
        *self.0.state() = State::Closed;
        self.0.ended.notify_all();
    }
}

impl Registration {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The endpoint id, unless the registration is closed or closing.
    fn endpoint_id(&self) -> PyResult<EndpointId> {
        match &*self.state() {
            State::Open(k) => Ok(k.id()),
            State::Closing | State::Closed => {
                Err(ClosedError::new_err(format!("registration {} is closed", self.id)))
            }
        }
    }

    /// Blocks until no close is deregistering it any more.
    fn wait_closed(&self) {
        let mut state = self.state();
        while matches!(*state, State::Closing) {
            state = self.ended.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Refuses bytes `offset .. offset + length` unless they lie inside the registration.
    fn check_range(&self, offset: u64, length: u64) -> PyResult<()> {
        match offset.checked_add(length) {
            Some(end) if end <= self.length => Ok(()),
            _ => Err(PyValueError::new_err(format!(
                "bytes {offset} .. {offset} + {length} lie outside the registration's {} bytes",
                self.length
            ))),
        }
    }
}

#[pymethods]
impl Registration {
    /// The endpoint id objects and ranges name it by: a slot of the engine's registry in the
    /// low 32 bits, its generation in the high 32. A slot is reused after its registration
    /// ends, with the next generation, so the id of an ended registration names nothing.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }

    /// Its length in bytes.
    #[getter]
    fn length(&self) -> u64 {
        self.length
    }

    /// `"host"`, `"device"` or `"file"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// What errors call it: the label given at registration, else a file's path; `None`
    /// otherwise (and once closed).
    #[getter]
    fn label(&self) -> Option<String> {
        match &*self.state() {
            State::Open(k) => self.registry.name(k.id()).map(|name| name.to_string()),
            State::Closing | State::Closed => None,
        }
    }

    /// Names it `label` in errors; `Engine.register*(..., label=...)` calls it.
    fn _set_label(&self, label: &str) -> PyResult<()> {
        match &*self.state() {
            State::Open(Kept::Memory(g)) => g.set_label(label),
            State::Open(Kept::File(g)) => g.set_label(label),
            State::Closing | State::Closed => {
                return Err(ClosedError::new_err(format!("registration {} is closed", self.id)))
            }
        }
        Ok(())
    }

    /// Whether it has been closed.
    #[getter]
    fn closed(&self) -> bool {
        !matches!(*self.state(), State::Open(_))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!("Registration(id={}, kind={}, length={}{state})", self.id, self.kind, self.length)
    }

    /// Deregisters (waiting for the batches that use it, with the GIL released), then releases
    /// the memory or file it kept. Idempotent, from any number of threads at once: every close
    /// returns only once the registration has ended, whichever of them deregisters it.
    fn close(&self, py: Python<'_>) {
        let kept = {
            let mut state = self.state();
            match std::mem::replace(&mut *state, State::Closing) {
                State::Open(kept) => Some(kept),
                other => {
                    *state = other;
                    None
                }
            }
        };
        match kept {
            Some(kept) => {
                let _closed = MarkClosed(self);
                py.allow_threads(move || drop(kept));
            }
            // Closed, or another close is deregistering it: wait for the same end.
            None => py.allow_threads(|| self.wait_closed()),
        }
        // Taken out of the lock before it goes: letting go of a Python object may run Python
        // code, which may come back here.
        let owner = self.owner.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(owner);
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(PoisonError::into_inner),
            State::Closed,
        );
        if let State::Open(kept) = state {
            // Garbage collection runs with the GIL held; deregistering may wait for a batch.
            // The owner (a field) goes after this, once the memory is no longer registered.
            Python::with_gil(|py| py.allow_threads(move || drop(kept)));
        }
    }
}

/// A batch in flight; see the Python `umbp.Batch`.
#[pyclass(module = "umbp._native")]
struct Batch {
    batch: Option<CompositeBatch>,
    /// The layer events, for a batch on a caller's stream.
    events: Option<Events>,
}

impl Batch {
    fn get(&self) -> PyResult<&CompositeBatch> {
        self.batch.as_ref().ok_or_else(|| Error::new_err("the batch was released"))
    }
}

fn state_name(s: ObjectState) -> &'static str {
    match s {
        ObjectState::InFlight => "in_flight",
        ObjectState::Completed => "completed",
        ObjectState::Rejected => "rejected",
        ObjectState::Failed => "failed",
        ObjectState::Cancelled => "cancelled",
    }
}

/// The name of a rejection's reason, as `umbp.RejectKind` spells it.
fn reject_kind(e: &umbp_plan::Error) -> &'static str {
    match e {
        umbp_plan::Error::Rejected { reason, .. } => reason.kind_name(),
        umbp_plan::Error::Walk(_) => "invalid_object",
        _ => "other",
    }
}

/// `umbp.<enum>(value)`: a member of one of the package's enums, or the plain string should
/// the package not be importable (it always is once an error can be raised).
fn py_enum(py: Python<'_>, name: &str, value: &str) -> PyObject {
    let member = (|| py.import("umbp")?.getattr(name)?.call1((value,)))();
    match member {
        Ok(m) => m.unbind(),
        Err(_) => value.into_pyobject(py).map(|s| s.into_any().unbind()).unwrap_or(py.None()),
    }
}

/// The object's error as an exception instance, with its typed details as attributes: `tag`
/// (the caller's tag of the object; None for `Engine.read` and `Engine.write`), `kind` (a
/// `umbp.RejectKind` or `umbp.FailureKind`) and, for an I/O failure, an `OSError` with the
/// errno as `__cause__`.
fn object_error(py: Python<'_>, e: &ObjectError, tag: Option<u64>) -> PyResult<PyObject> {
    let mut cause = None;
    let (err, mut attrs): (PyErr, Vec<(&str, PyObject)>) = match e {
        ObjectError::Rejected(plan, _) => {
            // In the caller's terms: endpoints by their labels or paths.
            let reason = e.rejection().unwrap_or_default();
            (
                RejectedError::new_err(e.to_string()),
                vec![
                    ("reason", reason.into_pyobject(py)?.into_any().unbind()),
                    ("kind", py_enum(py, "RejectKind", reject_kind(plan))),
                ],
            )
        }
        ObjectError::Failed { engine, cause: failure, .. } => {
            let (errno, code) = match failure {
                FailureCause::Io { errno } => (Some(*errno), None),
                FailureCause::Device { code, .. } => (None, Some(*code)),
                _ => (None, None),
            };
            if let Some(errno) = errno {
                let text = std::io::Error::from_raw_os_error(errno).to_string();
                cause = Some(pyo3::exceptions::PyOSError::new_err((errno, text)));
            }
            (
                TransferError::new_err(e.to_string()),
                vec![
                    ("engine", engine.clone().into_pyobject(py)?.into_any().unbind()),
                    ("cause", failure.to_string().into_pyobject(py)?.into_any().unbind()),
                    ("kind", py_enum(py, "FailureKind", failure.kind_name())),
                    ("errno", errno.into_pyobject(py)?.into_any().unbind()),
                    ("device_code", code.into_pyobject(py)?.into_any().unbind()),
                ],
            )
        }
        ObjectError::Cancelled => (CancelledError::new_err(e.to_string()), vec![]),
        other => (Error::new_err(other.to_string()), vec![]),
    };
    attrs.push(("tag", tag.into_pyobject(py)?.into_any().unbind()));
    let value = err.value(py);
    for (name, v) in attrs {
        value.setattr(name, v)?;
    }
    if let Some(cause) = cause {
        err.set_cause(py, Some(cause));
    }
    Ok(value.clone().into_any().unbind())
}

/// `(aggregate, [(tag, state, error or None, checksum or None)])`.
fn report_tuple(py: Python<'_>, r: &TransferReport) -> PyResult<ReportTuple> {
    let objects = r
        .objects
        .iter()
        .map(|o| {
            let error = o.error.as_ref().map(|e| object_error(py, e, Some(o.tag))).transpose()?;
            Ok((o.tag, state_name(o.state), error, o.checksum))
        })
        .collect::<PyResult<_>>()?;
    let aggregate = match r.aggregate {
        BatchState::InFlight => "in_flight",
        BatchState::Completed => "completed",
        BatchState::Failed => "failed",
    };
    Ok((aggregate, objects))
}

#[pymethods]
impl Batch {
    // The GIL is released around every call into the engines, even those that only take a
    // lock for a moment: a thread of theirs holding that lock may be waiting for the GIL to
    // hand a log record to Python.

    /// Whether every object has settled.
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        let batch = self.get()?;
        Ok(py.allow_threads(|| batch.is_done()))
    }

    /// The state of the object tagged `tag`, or None.
    fn state(&self, py: Python<'_>, tag: u64) -> PyResult<Option<&'static str>> {
        let batch = self.get()?;
        Ok(py.allow_threads(|| batch.state(tag)).map(state_name))
    }

    /// Where the batch stands now.
    fn report(&self, py: Python<'_>) -> PyResult<ReportTuple> {
        let batch = self.get()?;
        let r = py.allow_threads(|| batch.report());
        report_tuple(py, &r)
    }

    /// Blocks (GIL released) until every object settled, or `timeout` seconds passed (then
    /// returns None).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<ReportTuple>> {
        let (batch, timeout) = (self.get()?, timeout_of(timeout)?);
        let report = py.allow_threads(|| match timeout {
            None => Some(batch.wait()),
            Some(t) => batch.wait_timeout(t),
        });
        report.map(|r| report_tuple(py, &r)).transpose()
    }

    /// Blocks (GIL released) until layer groups up to `group` settled; False on timeout.
    #[pyo3(signature = (group, timeout=None))]
    fn wait_group(&self, py: Python<'_>, group: u32, timeout: Option<f64>) -> PyResult<bool> {
        let (batch, timeout) = (self.get()?, timeout_of(timeout)?);
        Ok(py.allow_threads(|| match timeout {
            None => {
                batch.wait_group(group);
                true
            }
            Some(t) => batch.wait_group_timeout(group, t),
        }))
    }

    /// Blocks (GIL released) until layer groups up to `group` are done or queued on the
    /// batch's stream; False on timeout.
    #[pyo3(signature = (group, timeout=None))]
    fn wait_group_enqueued(
        &self,
        py: Python<'_>,
        group: u32,
        timeout: Option<f64>,
    ) -> PyResult<bool> {
        let (batch, timeout) = (self.get()?, timeout_of(timeout)?);
        Ok(py.allow_threads(|| match timeout {
            None => {
                batch.wait_group_enqueued(group);
                true
            }
            Some(t) => batch.wait_group_enqueued_timeout(group, t),
        }))
    }

    /// The raw event recorded on the batch's stream once layer group `group` was enqueued
    /// (waits for it, GIL released); None on timeout. Valid while the batch lives.
    #[pyo3(signature = (group, timeout=None))]
    fn group_event(
        &self,
        py: Python<'_>,
        group: u32,
        timeout: Option<f64>,
    ) -> PyResult<Option<u64>> {
        let events = self
            .events
            .as_ref()
            .ok_or_else(|| Error::new_err("the batch was started without a stream"))?;
        let timeout = timeout_of(timeout)?;
        py.allow_threads(|| events.event(group, timeout)).map_err(error)
    }

    /// Skips what has not started and returns once nothing runs any more.
    fn cancel(&self, py: Python<'_>) -> PyResult<ReportTuple> {
        let batch = self.get()?;
        let r = py.allow_threads(|| batch.cancel());
        report_tuple(py, &r)
    }

    /// Calls `callback()` once the batch is done, on the thread that finishes it (or at once
    /// if it is done already): no thread waits for it. For `await` (`umbp.Batch.__await__`).
    fn call_when_done(&self, py: Python<'_>, callback: PyObject) -> PyResult<()> {
        let batch = self.get()?;
        let call = move || {
            Python::with_gil(move |py| {
                if let Err(e) = callback.call0(py) {
                    e.print(py);
                }
                drop(callback);
            })
        };
        py.allow_threads(move || batch.on_settled(call));
        Ok(())
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            // Dropping a batch waits for it; not with the GIL held.
            Python::with_gil(|py| py.allow_threads(move || drop(batch)));
        }
    }
}

impl Engine {
    fn composite(&self) -> &Arc<CompositeEngine> {
        self.composite.as_ref().expect("taken only when the engine is dropped")
    }

    /// A registration of this engine's, keeping `kept` (and `owner`).
    fn registration(
        &self,
        kept: Kept,
        owner: Option<PyObject>,
        kind: &'static str,
    ) -> Registration {
        let (id, length) = (kept.id().raw(), kept.len());
        Registration {
            state: Mutex::new(State::Open(kept)),
            ended: Condvar::new(),
            owner: Mutex::new(owner),
            registry: Arc::clone(self.composite().registry()),
            kind,
            id,
            length,
        }
    }

    /// The endpoint `registration` names, if it is open and this engine's: another engine's
    /// ids name other memory here.
    fn endpoint(&self, registration: &Registration) -> PyResult<EndpointId> {
        if !Arc::ptr_eq(&registration.registry, self.composite().registry()) {
            return Err(PyValueError::new_err(format!(
                "registration {} belongs to another engine",
                registration.id
            )));
        }
        registration.endpoint_id()
    }

    /// The endpoint an object or range names: a registration ([`endpoint`](Self::endpoint)),
    /// or a raw id, which may not be the bounce region the staged route owns.
    fn named(&self, endpoint: &EndpointArg<'_>) -> PyResult<EndpointId> {
        match endpoint {
            EndpointArg::Registration(r) => self.endpoint(r.get()),
            EndpointArg::Raw(raw) => {
                let bounce = self.bounce.as_ref().expect("taken only when the engine is dropped");
                if *raw == bounce.id().raw() {
                    return Err(PyValueError::new_err(format!(
                        "endpoint {raw} is the engine's bounce region, not one of yours"
                    )));
                }
                Ok(EndpointId::from_raw(*raw))
            }
        }
    }

    fn device(&self) -> &Device {
        self.device.as_ref().expect("taken only by drop")
    }

    fn remote(&self) -> PyResult<&Arc<RemoteEngine>> {
        self.remote.as_ref().ok_or_else(|| {
            PyValueError::new_err("this engine has no remote tier: make it with remote=True")
        })
    }
}

/// The remote tier's settings from Python: `transports`, the shared `secret` (`None`: the
/// default's, from `UMBP_UCX_SECRET`), whether to run without authentication and the TCP
/// congestion control.
fn ucx_config(
    transports: Option<String>,
    secret: Option<Vec<u8>>,
    insecure_no_auth: bool,
    congestion: Congestion,
) -> RemoteConfig {
    let mut config =
        RemoteConfig { transports, insecure_no_auth, congestion, ..RemoteConfig::default() };
    if secret.is_some() {
        config.secret = secret;
    }
    config
}

/// The congestion control spelled `value` (`"auto"`, `"system"` or an algorithm's name);
/// `ValueError` naming the `argument` otherwise. Whether the kernel allows the algorithm is
/// known only when the engine or server starts (`umbp.Error` then).
fn congestion(value: &str, argument: &str) -> PyResult<Congestion> {
    value.parse().map_err(|e| PyValueError::new_err(format!("{argument}={value:?}: {e}")))
}

/// `(region, name, length, writable)` of one region a peer exports.
type RegionTuple = (u32, String, u64, bool);

/// Host buffers exported to other nodes over UCX until closed.
#[pyclass(module = "umbp._native")]
struct Server {
    server: Option<RemoteServer>,
    /// What backs the regions; released only after the server stopped.
    owners: Vec<PyObject>,
}

#[pymethods]
impl Server {
    /// Exports `regions` (`(name, addr, length, writable, owner)`: the Python layer passes
    /// buffers it holds exported in `owner`) and serves them on `listen` to clients that prove
    /// they hold `secret` (`None`: `UMBP_UCX_SECRET`), or to anyone with `insecure_no_auth`.
    /// `node`: the pool node id it serves as, named in every client's welcome
    /// ([`ServerBuilder::node`]); a pool's clients refuse a server naming another or none.
    /// `congestion`: the TCP congestion control of its connections, as the engine's
    /// `remote_congestion`.
    #[new]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    #[pyo3(signature = (listen, regions, transports=None, secret=None, insecure_no_auth=false, node=None, congestion="auto"))]
    fn new(
        py: Python<'_>,
        listen: String,
        regions: Vec<(String, u64, u64, bool, PyObject)>,
        transports: Option<String>,
        secret: Option<Vec<u8>>,
        insecure_no_auth: bool,
        node: Option<u32>,
        congestion: &str,
    ) -> PyResult<Self> {
        let congestion = self::congestion(congestion, "congestion")?;
        let config = ucx_config(transports, secret, insecure_no_auth, congestion);
        let mut builder = ServerBuilder::new(config);
        if let Some(node) = node {
            builder = builder.node(node);
        }
        let mut owners = Vec::with_capacity(regions.len());
        for (name, addr, length, writable, owner) in regions {
            // SAFETY: `owner` holds the buffer's export, so the memory stays allocated until
            // this object releases it, which `close` and `drop` do only after the server has
            // stopped (and UCX has unmapped it).
            builder = unsafe { builder.export_raw(&name, addr, length, writable) };
            owners.push(owner);
        }
        let server = py.allow_threads(|| builder.serve(listen.as_str())).map_err(error)?;
        Ok(Self { server: Some(server), owners })
    }

    /// `host:port` where clients connect.
    #[getter]
    fn address(&self) -> PyResult<String> {
        let server = self.server.as_ref().ok_or_else(|| Error::new_err("the server is closed"))?;
        Ok(server.local_addr().to_string())
    }

    /// Control connections open now.
    #[getter]
    fn clients(&self, py: Python<'_>) -> usize {
        // Without the GIL: the server's thread may hold what this reads while it logs.
        py.allow_threads(|| self.server.as_ref().map_or(0, RemoteServer::clients))
    }

    /// Stops serving (clients see the node go away), then releases the buffers.
    fn close(&mut self, py: Python<'_>) {
        if let Some(server) = self.server.take() {
            py.allow_threads(|| drop(server));
        }
        self.owners.clear();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // The server stops (and unmaps) before the owners go, with the GIL released: stopping
        // waits for the server's thread, which may be waiting for the GIL to log.
        if let Some(server) = self.server.take() {
            Python::with_gil(|py| py.allow_threads(move || drop(server)));
        }
    }
}

/// The `umbp._native` module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Engine>()?;
    m.add_class::<Registration>()?;
    m.add_class::<Batch>()?;
    m.add_class::<Server>()?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("RegistrationError", py.get_type::<RegistrationError>())?;
    m.add("RejectedError", py.get_type::<RejectedError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("CancelledError", py.get_type::<CancelledError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("DuplicateTagError", py.get_type::<DuplicateTagError>())?;
    m.add("CUDA", cfg!(feature = "cuda"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The optional attributes are None unless set: `tag` on every exception (the object's,
    // when one comes from a report), and the numbers only some failures have. The others
    // (`reason`, `kind`, `engine`, `cause`) are set on every instance the engines raise.
    let none = py.None();
    py.get_type::<Error>().setattr("tag", &none)?;
    py.get_type::<RegistrationError>().setattr("errno", &none)?;
    for name in ["errno", "device_code"] {
        py.get_type::<TransferError>().setattr(name, &none)?;
    }
    m.add_function(wrap_pyfunction!(reset_log_cache, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c_combine, m)?)?;
    m.add_function(wrap_pyfunction!(serve_memory_node, m)?)?;
    pool::register(m)?;
    install_logger(py);
    Ok(())
}

/// What makes Python's `logging` see the events of the Rust crates, once per process.
///
/// The crates emit `tracing` events. With tracing's `log` feature (enabled by this crate) an
/// event becomes a `log` record whenever no tracing subscriber is installed, as none is in
/// this extension, and pyo3-log hands each record to the Python logger named after the event's
/// target with `::` read as `.` (`umbp_ssd.engine`, `umbp_remote.server`...). A bridge of our own
/// would have had to redo pyo3-log's cache of each logger's level, which lets a thread skip a
/// disabled event without taking the GIL.
static LOG_RESET: OnceLock<Option<pyo3_log::ResetHandle>> = OnceLock::new();

fn install_logger(py: Python<'_>) {
    LOG_RESET.get_or_init(|| {
        let logger = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels).ok()?;
        // Fails only if a logger is installed already (the module initialized again, in a
        // subinterpreter): that one forwards the records.
        logger.install().ok()
    });
}

/// The checksum of `a ‖ b` from `first = crc32c(a)`, `second = crc32c(b)` and `second_len =
/// len(b)`: how a caller that saved an object in pieces (one offload per layer, say) gets the
/// checksum a restore of the whole object verifies.
#[pyfunction]
fn crc32c_combine(first: u32, second: u32, second_len: u64) -> u32 {
    umbp_plan::checksum::combine(first, second, second_len)
}

/// Runs the memory node command `umbp-ucx-serve` with `argv` (the program's name first) until
/// it stops, without the GIL, and returns its exit status: what the package's console script
/// of that name runs (`umbp.memory_node.main`). It installs its own handlers for SIGTERM and
/// SIGINT and exits the process for `--help`, `--version` and bad flags: call it only from a
/// process that is to become the memory node.
#[pyfunction]
fn serve_memory_node(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    py.allow_threads(|| umbp_memory_node::serve::main(argv))
}

/// Forgets the loggers and levels the Rust side has cached: call it after changing the level
/// of a logger the crates log to (`logging.getLogger("umbp_ssd").setLevel(...)`), which the
/// cache would otherwise keep ignoring for targets it has already seen.
#[pyfunction]
fn reset_log_cache() {
    if let Some(Some(handle)) = LOG_RESET.get() {
        handle.reset();
    }
}
