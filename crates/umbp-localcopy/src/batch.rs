//! The batch API: plan and copy a list of transfers in one call, with one result per object.

use umbp_plan::{
    BatchState, BatchStatus, Failure, Fragment, PlanBuilder, RejectReason, Tag, TransferEngine,
};

use crate::{Error, LocalCopyBuilder, LocalCopyEngine};

/// The most objects one batch can name: one per `u32` tag.
const MAX_OBJECTS: u64 = 1 << 32;

/// What one [`LocalCopyEngine::transfer_batch`] did, per object and in aggregate.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// One state per object `0 .. objects` and the aggregate
    /// ([`BatchStatus::aggregate`]): completed only when every object completed.
    pub status: BatchStatus,
    /// The objects refused while planning, each with the reason its first refused transfer
    /// gave; nothing of these objects was written.
    pub rejections: Vec<(Tag, RejectReason)>,
    /// The plans that failed while copying, with the objects they carried.
    pub failures: Vec<Failure>,
}

impl BatchReport {
    /// The aggregate state of the batch: [`BatchState::Completed`] when every object
    /// completed, [`BatchState::Failed`] otherwise.
    pub fn aggregate(&self) -> BatchState {
        self.status.aggregate()
    }
}

impl LocalCopyEngine {
    /// Plans `transfers` and copies them in one submit: each [`Fragment`] is one
    /// `(src, src_offset, dst, dst_offset, len, tag)` transfer, and the batch's objects are
    /// the tags `0 .. objects`.
    ///
    /// The transfers of one object are planned inside one object scope, so an object with a
    /// refused transfer (out of bounds, unknown endpoint, a device or file endpoint) is
    /// rejected whole and none of its bytes are written, while its sibling objects go ahead.
    /// Transfers may come in any order; grouped by tag (ascending) they are planned in one
    /// pass without sorting. An object without transfers completes.
    ///
    /// Errors, with nothing planned or copied: [`Error::UnknownTag`] when a transfer's tag is
    /// `objects` or more; [`Error::TooManyObjects`] when `objects` passes 2^32, one per tag;
    /// [`Error::OutOfMemory`] when the report's states (one byte per object: 4 GiB for 2^32
    /// objects) or the order of unsorted transfers (a word each) cannot be allocated.
    /// Per-object outcomes are in the report, never an error. Memory: the report holds one
    /// state per object; planning takes memory in proportion to `transfers` only, whatever
    /// their tags.
    ///
    /// ```
    /// use umbp_localcopy::LocalCopyEngine;
    /// use umbp_plan::{BatchState, EndpointRegistry, Fragment, ObjectState, Register, Tag};
    ///
    /// let engine = LocalCopyEngine::new(EndpointRegistry::new());
    /// let src = engine.register_memory((0..=255).collect::<Vec<u8>>())?;
    /// let dst = engine.register_memory(vec![0u8; 256])?;
    /// let (s, d) = (src.id(), dst.id());
    /// let transfers = [
    ///     Fragment::new(s, 128, d, 0, 128, Tag::new(0)),
    ///     Fragment::new(s, 0, d, 128, 128, Tag::new(1)),
    ///     Fragment::new(s, 200, d, 0, 100, Tag::new(2)), // past the end of `src`
    /// ];
    /// let report = engine.transfer_batch(3, &transfers)?;
    /// assert_eq!(report.status.object(Tag::new(0)), Some(ObjectState::Completed));
    /// assert_eq!(report.status.object(Tag::new(2)), Some(ObjectState::Rejected));
    /// assert_eq!(report.aggregate(), BatchState::Failed);
    /// let dst = dst.deregister();
    /// assert_eq!((dst[0], dst[128]), (128, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn transfer_batch(
        &self,
        objects: usize,
        transfers: &[Fragment],
    ) -> Result<BatchReport, Error> {
        if objects as u64 > MAX_OBJECTS {
            return Err(Error::TooManyObjects { objects });
        }
        if let Some(f) = transfers.iter().find(|f| f.tag.index() >= objects) {
            return Err(Error::UnknownTag { tag: f.tag, objects });
        }
        // Before planning, so that nothing runs for a batch whose report cannot be made.
        let mut status = BatchStatus::try_new(objects)
            .map_err(|_| Error::OutOfMemory { what: "object states", count: objects })?;
        let mut builder = self.incremental_builder();
        let mut rejections = Vec::new();
        if transfers.windows(2).all(|w| w[0].tag <= w[1].tag) {
            plan_objects(&mut builder, transfers.iter(), &mut rejections)?;
        } else {
            let order = by_tag(transfers)
                .ok_or(Error::OutOfMemory { what: "transfer order", count: transfers.len() })?;
            let sorted = order.iter().map(|&i| &transfers[i]);
            plan_objects(&mut builder, sorted, &mut rejections)?;
        }
        let plans = builder.finish()?;
        let settled = self.submit(plans).into_settled();
        status.settle(settled.plans.rejected(), &settled.failures)?;
        Ok(BatchReport { status, rejections, failures: settled.failures })
    }
}

/// Pushes `transfers` (grouped by tag) into `builder`, one object scope per tag, recording the
/// reason of each rejected object.
fn plan_objects<'a>(
    builder: &mut LocalCopyBuilder,
    transfers: impl Iterator<Item = &'a Fragment>,
    rejections: &mut Vec<(Tag, RejectReason)>,
) -> Result<(), umbp_plan::Error> {
    let mut open = None;
    for f in transfers {
        if open != Some(f.tag) {
            if open.is_some() {
                builder.commit_object()?;
            }
            builder.begin_object(f.tag)?;
            open = Some(f.tag);
        }
        match builder.push(*f) {
            Ok(()) | Err(umbp_plan::Error::ObjectRejected { .. }) => {}
            Err(umbp_plan::Error::Rejected { tag, reason }) => rejections.push((tag, reason)),
            Err(other) => return Err(other),
        }
    }
    if open.is_some() {
        builder.commit_object()?;
    }
    Ok(())
}

/// The indices of `transfers` ordered by tag, stable within a tag, or `None` if they cannot
/// be allocated. A comparison sort, so the memory it takes follows the number of transfers,
/// never the values of their tags (a counting sort over tags up to 2^32 would take 32 GiB).
fn by_tag(transfers: &[Fragment]) -> Option<Vec<usize>> {
    let mut order = Vec::new();
    order.try_reserve_exact(transfers.len()).ok()?;
    order.extend(0..transfers.len());
    // Unstable (no buffer to allocate), and stable all the same: the keys break ties by index.
    order.sort_unstable_by_key(|&i| (transfers[i].tag, i));
    Some(order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_plan::EndpointId;

    #[test]
    fn by_tag_is_a_stable_counting_sort() {
        let f = |tag| {
            Fragment::new(EndpointId::from_raw(0), 0, EndpointId::from_raw(1), 0, 1, Tag::new(tag))
        };
        let transfers = [f(2), f(0), f(2), f(1), f(0)];
        assert_eq!(by_tag(&transfers).unwrap(), [1, 4, 3, 0, 2]);
        assert!(by_tag(&[]).unwrap().is_empty());
    }
}
