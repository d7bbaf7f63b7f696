//! Routing: which engine carries a pair. A pure decision over the pair and each engine's
//! `can_handle`, in preference order.

use std::sync::Arc;

use umbp_plan::{Endpoint, TransferEngine};

/// Where a (source, destination) pair goes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// The first engine, in preference order, that claims the pair.
    Direct(usize),
    /// No engine claims the pair, but one carries source to the bounce region and one carries
    /// the bounce region to the destination: two hops through host memory.
    Staged {
        /// Engine of the first hop (source to bounce).
        read: usize,
        /// Engine of the second hop (bounce to destination).
        write: usize,
    },
    /// Nothing carries the pair: its objects are rejected.
    Unrouted,
}

/// Routes `src -> dst` over `engines` (in preference order), through `bounce` when no engine
/// claims the pair directly.
pub fn route(
    engines: &[Arc<dyn TransferEngine>],
    bounce: Option<&Endpoint>,
    src: &Endpoint,
    dst: &Endpoint,
) -> Route {
    let first = |s: &Endpoint, d: &Endpoint| engines.iter().position(|e| e.can_handle(s, d));
    if let Some(i) = first(src, dst) {
        return Route::Direct(i);
    }
    match bounce.map(|b| (first(src, b), first(b, dst))) {
        Some((Some(read), Some(write))) => Route::Staged { read, write },
        _ => Route::Unrouted,
    }
}
