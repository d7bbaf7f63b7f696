//! The restore and offload entry points: paged objects in, one result per object out, as a
//! [`Batch`] to poll or wait on, or blocking.

use std::collections::HashSet;

use umbp_plan::{check_ranges, Error as PlanError, Fragment, PageWalk, Tag};

use crate::batch::{Batch, TransferReport};
use crate::builder::CompositeBuilder;
use crate::error::Error;
use crate::integrity::{ChecksPlan, ChecksumPolicy};
use crate::object::ObjectTransfer;

/// Starts restoring `objects` (their ranges from the tier into the caller's destinations) in
/// one batch and returns it at once: validates each object's ranges and pages, walks them into
/// `builder` with one object scope per object (an object that fails any check is rejected with
/// its reason and leaves nothing behind), and submits to the builder's composite.
///
/// An object given a [`checksum`](ObjectTransfer::checksum), in a tier the composite's
/// [`ChecksumPolicy`] covers, completes only if its bytes have that CRC32C; otherwise it fails
/// with [`FailureCause::ChecksumMismatch`](umbp_plan::FailureCause::ChecksumMismatch) (or
/// [`ChecksumUnverifiable`](umbp_plan::FailureCause::ChecksumUnverifiable) when part of it
/// moved where it could not be hashed), and the batch's other objects are untouched.
///
/// Errors, before anything is planned: [`Error::DuplicateTag`], [`Error::BuilderInUse`] when
/// `builder` holds an unfinished batch; then those of [`CompositeEngine::submit`](crate::CompositeEngine::submit).
pub fn start_restore(
    builder: &mut CompositeBuilder,
    objects: &[ObjectTransfer<'_>],
) -> Result<Batch, Error> {
    start(builder, objects, Direction::Restore)
}

/// [`start_restore`], then waits: blocks until every object has settled, recycles the plans
/// into `builder` and returns one result per object.
pub fn restore(
    builder: &mut CompositeBuilder,
    objects: &[ObjectTransfer<'_>],
) -> Result<TransferReport, Error> {
    let batch = start_restore(builder, objects)?;
    Ok(finish(builder, batch))
}

/// Starts offloading `objects`: writes their ranges from the caller's memory into the tier's
/// pages, in one batch (bytes of an object no range names are left as they are); as
/// [`start_restore`] otherwise. Each completed object in a tier the composite's
/// [`ChecksumPolicy`] covers reports the CRC32C of the bytes it wrote
/// ([`ObjectResult::checksum`](crate::ObjectResult::checksum)): record it with the block and
/// give it to the restore that loads it.
pub fn start_offload(
    builder: &mut CompositeBuilder,
    objects: &[ObjectTransfer<'_>],
) -> Result<Batch, Error> {
    start(builder, objects, Direction::Offload)
}

/// [`start_offload`], then waits, as [`restore`].
pub fn offload(
    builder: &mut CompositeBuilder,
    objects: &[ObjectTransfer<'_>],
) -> Result<TransferReport, Error> {
    let batch = start_offload(builder, objects)?;
    Ok(finish(builder, batch))
}

fn finish(builder: &mut CompositeBuilder, batch: Batch) -> TransferReport {
    let report = batch.wait();
    builder.recycle(batch.into_plans());
    report
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Direction {
    Restore,
    Offload,
}

fn start(
    builder: &mut CompositeBuilder,
    objects: &[ObjectTransfer<'_>],
    direction: Direction,
) -> Result<Batch, Error> {
    if !builder.is_idle() {
        return Err(Error::BuilderInUse);
    }
    if u32::try_from(objects.len()).is_err() {
        return Err(Error::TooManyObjects(objects.len()));
    }
    let mut seen = HashSet::with_capacity(objects.len());
    if let Some(o) = objects.iter().find(|o| !seen.insert(o.tag)) {
        return Err(Error::DuplicateTag(o.tag));
    }
    // The log names objects by the caller's tags, not by these positions.
    builder.set_caller_tags(objects.iter().map(|o| o.tag));
    let span = tracing::info_span!("umbp.build", objects = objects.len());
    let plans = {
        let _enter = span.enter();
        for (i, o) in objects.iter().enumerate() {
            // Batch-internal tags are positions, so results map back without a lookup.
            let tag = Tag::new(i as u32);
            builder.begin_object(tag)?;
            match plan_object(builder, tag, o, direction) {
                Ok(()) => builder.commit_object()?,
                Err(reason) => builder.reject_object(reason)?,
            }
        }
        builder.finish()?
    };
    let keys = objects.iter().map(|o| o.tag).collect();
    let restore = direction == Direction::Restore;
    let checked = builder.composite().config().checksums != ChecksumPolicy::Off
        && (!restore || objects.iter().any(|o| o.checksum.is_some()));
    let checks = checked.then(|| ChecksPlan::new(restore, objects));
    builder.composite().start(plans, Some(keys), checks)
}

/// Checks one object's ranges and pages and pushes its fragments into the open object.
fn plan_object(
    builder: &mut CompositeBuilder,
    tag: Tag,
    o: &ObjectTransfer<'_>,
    direction: Direction,
) -> Result<(), PlanError> {
    check_ranges(o.ranges.iter().map(|r| (r.offset, r.len)), o.object.size)?;
    let walk = PageWalk::new(o.object.page_offsets, o.object.page_size, o.object.size)?;
    for r in o.ranges {
        builder.set_group(r.group);
        match direction {
            // The walk's tier is the source: one call per range, the engine's fast path.
            Direction::Restore => builder.push_walk(
                o.object.tier,
                r.endpoint,
                &walk,
                r.offset,
                r.len,
                r.endpoint_offset,
            )?,
            // The tier is the destination: the walk's pages are where the bytes go.
            Direction::Offload => walk.walk(r.offset, r.len, r.endpoint_offset, |page| {
                builder.push(Fragment::new(
                    r.endpoint,
                    page.dst_offset,
                    o.object.tier,
                    page.tier_offset,
                    page.len,
                    tag,
                ))
            })?,
        }
    }
    Ok(())
}
