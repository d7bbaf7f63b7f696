//! The crate's error type.

use umbp_plan::{DeviceOrdinal, EndpointId};

/// What a device runtime can report.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The runtime failed a call with its own error code and message.
    #[error("device {}: runtime error {code}: {message}", .device.get())]
    Runtime {
        /// The device the call was for.
        device: DeviceOrdinal,
        /// The runtime's error code (`hipError_t` for HIP).
        code: i32,
        /// The runtime's message.
        message: String,
    },
    /// No device with this ordinal.
    #[error("no device {}", .0.get())]
    NoDevice(DeviceOrdinal),
    /// Bytes `addr .. + len` are not memory this device may touch (the simulated device checks
    /// every descriptor and copy; the HIP backend trusts the engine's checks).
    #[error("device {}: bytes {addr:#x}..+{len} are outside every region it knows", .device.get())]
    InvalidAddress {
        /// The device.
        device: DeviceOrdinal,
        /// First byte.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The device could not allocate `len` bytes.
    #[error("device {}: out of memory allocating {len} bytes", .device.get())]
    OutOfMemory {
        /// The device.
        device: DeviceOrdinal,
        /// Bytes asked for.
        len: u64,
    },
    /// The gather kernel failed to compile for the device's architecture.
    #[error("gather kernel does not compile for {arch}: {log}")]
    KernelCompile {
        /// The architecture, for example `gfx90a`.
        arch: String,
        /// The compiler's log.
        log: String,
    },
    /// A runtime library is not on this machine (or not on the loader's search path): the
    /// CUDA driver or NVRTC, which the CUDA backend loads at run time.
    #[error("{library} cannot be loaded: {reason}")]
    LibraryMissing {
        /// The library (`libcuda`, `libnvrtc`).
        library: &'static str,
        /// What the loader said.
        reason: String,
    },
    /// The simulated device refused to pin host memory that overlaps memory already pinned,
    /// as CUDA's and HIP's host registration refuse it (a GPU runtime reports that as a
    /// [`Runtime`](Self::Runtime) error with its own code: CUDA's 712). The simulator says so
    /// in its own words rather than imitate a runtime's code.
    #[error(
        "device {} (simulated): host memory {addr:#x}..+{len} overlaps memory already pinned for \
         a device; pin it once (register an arena once and name its bytes by offset)",
        .device.get()
    )]
    AlreadyPinned {
        /// The device.
        device: DeviceOrdinal,
        /// First byte of the refused range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A fault injected into the simulated device.
    #[error("injected fault: {0:?}")]
    Injected(crate::sim::DeviceFault),
}

impl DeviceError {
    /// The runtime error code, if the runtime gave one.
    pub fn code(&self) -> i32 {
        match self {
            DeviceError::Runtime { code, .. } => *code,
            _ => -1,
        }
    }
}

/// The error type of umbp-hbm.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The device runtime refused an operation.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The endpoint is not registered, or not with this engine.
    #[error("endpoint {} is not registered with this engine", .0.raw())]
    UnknownEndpoint(EndpointId),
    /// A region whose end does not fit in 64 bits.
    #[error("a region of {len} bytes at {addr:#x} cannot be registered")]
    BadRegion {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
}
