//! Test support shared by the simulated device's test files.
#![allow(dead_code)] // each test file uses part of it

use umbp_hbm::{HbmEngine, SimDevice};
use umbp_plan::{DeviceOrdinal, Endpoint, EndpointId, Register, Registration};

pub(crate) const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

/// A host buffer registered with the engine (pinned for GPU when `pin`).
pub(crate) struct Host {
    /// Declared (so dropped) before the buffer it registers.
    _registration: Registration,
    pub(crate) bytes: Vec<u8>,
    pub(crate) id: EndpointId,
}

pub(crate) fn host(e: &HbmEngine<SimDevice>, bytes: Vec<u8>, pin: bool) -> Host {
    let mut bytes = bytes;
    let endpoint = Endpoint::host(bytes.as_mut_ptr() as u64, bytes.len() as u64);
    // SAFETY: the Host keeps `bytes` alive until after the registration ends; tests read the
    // bytes only between transfers, each waited on. (Raw, so that the tests can read them.)
    let registration = unsafe { e.register_raw_memory(endpoint) }.unwrap();
    let id = registration.id();
    if pin {
        e.pin(id, GPU).unwrap();
    }
    Host { _registration: registration, bytes, id }
}
