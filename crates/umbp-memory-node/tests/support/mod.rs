//! What the memory node's tests share: UCX's presence, the tests' secret, an engine.
#![allow(dead_code)] // Each test file uses its own part.

use umbp_plan::EndpointRegistry;
use umbp_remote::{RemoteConfig, RemoteEngine};

/// The shared secret of the tests' nodes and engines.
pub(crate) const SECRET: &str = "umbp-remote test secret, 32 bytes!!";

/// Whether UCX is here; prints why a test skips. `UMBP_REQUIRE_UCX=1` (CI) makes its absence a
/// failure.
pub(crate) fn ucx_or_skip() -> bool {
    umbp_plan::testing::available_or_skip("UMBP_REQUIRE_UCX", umbp_remote::ucx_available())
}

/// The configuration of the tests' engines: `transports` and the tests' secret.
pub(crate) fn config(transports: &str) -> RemoteConfig {
    RemoteConfig {
        transports: Some(transports.to_owned()),
        secret: Some(SECRET.into()),
        ..RemoteConfig::default()
    }
}

/// An engine over a new registry, on `transports`, with the tests' secret.
pub(crate) fn engine(transports: &str) -> RemoteEngine {
    RemoteEngine::new(EndpointRegistry::new(), config(transports)).expect("the engine starts")
}
