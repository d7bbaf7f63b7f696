//! Memory nodes in a umbp pool (feature `pool`).
//!
//! - A memory node ([`UcxServer`](crate::UcxServer)) joins a pool with a [`Membership`]: each
//!   of its writable exported regions becomes a tier of fixed-size slots in the pool's
//!   [`Index`](umbp_pool::Index) (tier `i` is the `i`-th exported region, so a client maps a
//!   tier to a region by the handshake's list alone), its announcement (address, free bytes per
//!   tier) is renewed from a thread, and [`Membership::leave`] takes it out of the pool at once
//!   when it stops. `umbp-ucx-serve --pool redis://...` does all of this.
//! - A client's [`Pool`](umbp_pool::Pool) reaches those tiers through a [`UcxResolver`]: it
//!   connects to the node's announced address (with the shared secret) and registers the
//!   region with the pool's composite, one connection per node.

mod member;
mod resolver;

pub use member::{
    Membership, MembershipConfig, MembershipSnapshot, MembershipState, MembershipStats,
};
pub use resolver::UcxResolver;
