//! Plan rules: what an engine accepts, and the one validation every builder shares.

use crate::{Endpoint, EndpointId, EndpointTable, Fragment, RejectReason};

/// What one engine accepts. The incremental builder and the batch planner both check fragments
/// against these rules, so an engine states its limits once.
///
/// Implementations are small `Copy`-like values; their methods are called on the push path and
/// should be cheap and `#[inline]`.
pub trait PlanRules {
    /// Whether the engine carries bytes from `src` to `dst`. Called once per new plan, not per
    /// fragment.
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool;

    /// The largest segment the engine issues. A longer fragment is split into pieces of this
    /// length (the last one: the rest), in order, inside its object, so no caller has to know
    /// the engine's maximum; merging stops at this length. Default: no limit.
    #[inline]
    fn max_segment_len(&self) -> u64 {
        u64::MAX
    }

    /// Engine-specific checks of one in-bounds fragment (alignment, say). Default: accept.
    #[inline]
    fn check_fragment(
        &self,
        _src: &Endpoint,
        _dst: &Endpoint,
        _fragment: &Fragment,
    ) -> Result<(), RejectReason> {
        Ok(())
    }
}

impl<R: PlanRules + ?Sized> PlanRules for &R {
    #[inline]
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        (**self).carries(src, dst)
    }

    #[inline]
    fn max_segment_len(&self) -> u64 {
        (**self).max_segment_len()
    }

    #[inline]
    fn check_fragment(
        &self,
        src: &Endpoint,
        dst: &Endpoint,
        fragment: &Fragment,
    ) -> Result<(), RejectReason> {
        (**self).check_fragment(src, dst, fragment)
    }
}

/// Checks a non-empty fragment against `rules` and the endpoints of `table`, in a fixed order
/// (endpoints known, pair carried, source bounds, destination bounds, engine checks), and
/// returns the two endpoint descriptions when it passes. The engine's maximum segment is no
/// check: a fragment past it is valid and planned as pieces
/// ([`max_segment_len`](PlanRules::max_segment_len)); the engine checks the whole fragment.
pub fn validate<R: PlanRules + ?Sized>(
    rules: &R,
    table: &EndpointTable,
    fragment: &Fragment,
) -> Result<(Endpoint, Endpoint), RejectReason> {
    let (src, dst) = check_pair(rules, table, fragment.src, fragment.dst)?;
    check_bounds(fragment.src, &src, fragment.src_offset, fragment.len)?;
    check_bounds(fragment.dst, &dst, fragment.dst_offset, fragment.len)?;
    rules.check_fragment(&src, &dst, fragment)?;
    Ok((src, dst))
}

/// The first half of [`validate`]: both endpoints known and the pair carried.
pub(crate) fn check_pair<R: PlanRules + ?Sized>(
    rules: &R,
    table: &EndpointTable,
    src_id: EndpointId,
    dst_id: EndpointId,
) -> Result<(Endpoint, Endpoint), RejectReason> {
    let src = *table.get(src_id).ok_or(RejectReason::UnknownEndpoint(src_id))?;
    let dst = *table.get(dst_id).ok_or(RejectReason::UnknownEndpoint(dst_id))?;
    if !rules.carries(&src, &dst) {
        return Err(RejectReason::PairNotHandled { src: src_id, dst: dst_id });
    }
    Ok((src, dst))
}

fn check_bounds(
    id: EndpointId,
    endpoint: &Endpoint,
    offset: u64,
    len: u64,
) -> Result<(), RejectReason> {
    match offset.checked_add(len) {
        None => Err(RejectReason::Overflow { endpoint: id, offset, len }),
        Some(end) if end > endpoint.len() => Err(RejectReason::OutOfBounds {
            endpoint: id,
            offset,
            len,
            endpoint_len: endpoint.len(),
        }),
        Some(_) => Ok(()),
    }
}
