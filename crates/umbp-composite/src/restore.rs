//! The restore and offload entry points: paged objects in, one result per object out.

use umbp_plan::{
    check_ranges, BatchState, BatchStatus, EndpointId, Error as PlanError, Failure, Fragment,
    ObjectState, PageWalk, Tag, WalkError,
};

use crate::{CompositeBuilder, CompositeEngine, Outcome};

/// Where an object lives: its pages in a tier (a DRAM arena or an SSD file).
#[derive(Copy, Clone, Debug)]
pub struct PagedObject<'a> {
    /// The tier endpoint holding the pages.
    pub tier: EndpointId,
    /// Tier offsets of the object's pages, in object order.
    pub pages: &'a [u64],
    /// Page size.
    pub page_size: u64,
    /// Stored object size (the last page may be short).
    pub size: u64,
}

/// One range of an object and the caller's memory on the other side of the transfer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ObjectRange {
    /// Offset inside the object.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The caller's endpoint: the destination of a restore, the source of an offload.
    pub endpoint: EndpointId,
    /// Offset inside the caller's endpoint.
    pub endpoint_offset: u64,
}

/// One object of a restore or offload batch.
#[derive(Copy, Clone, Debug)]
pub struct ObjectTransfer<'a> {
    /// The caller's own tag for the object, given back in its result.
    pub tag: Tag,
    /// Where the object's pages are.
    pub object: PagedObject<'a>,
    /// The ranges to move, sorted by offset and disjoint (for an offload they must tile the
    /// object).
    pub ranges: &'a [ObjectRange],
}

/// The result of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectResult {
    /// The caller's tag.
    pub tag: Tag,
    /// Completed, rejected (bad range, page list or fragment) or failed (a transfer failed).
    pub state: ObjectState,
}

/// The result of a batch.
#[derive(Debug)]
pub struct TransferReport {
    /// One result per object, in the batch's order.
    pub objects: Vec<ObjectResult>,
    /// The aggregate: completed only if every object completed.
    pub aggregate: BatchState,
    /// Every execution failure, for diagnosis.
    pub failures: Vec<Failure>,
}

/// Restores `objects` (their ranges from the tier into the caller's destinations) in one
/// batch: validates ranges, walks pages into `builder` with one object scope per object,
/// submits once, waits once, and maps rejected and failed objects back to their tags.
pub fn restore(
    composite: &CompositeEngine,
    builder: &mut CompositeBuilder<'_>,
    objects: &[ObjectTransfer<'_>],
) -> TransferReport {
    run(composite, builder, objects, Direction::Restore)
}

/// Offloads `objects`: writes their ranges (which must tile each object) from the caller's
/// memory into the tier's pages, in one batch, with one result per object.
pub fn offload(
    composite: &CompositeEngine,
    builder: &mut CompositeBuilder<'_>,
    objects: &[ObjectTransfer<'_>],
) -> TransferReport {
    run(composite, builder, objects, Direction::Offload)
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Direction {
    Restore,
    Offload,
}

fn run(
    composite: &CompositeEngine,
    builder: &mut CompositeBuilder<'_>,
    objects: &[ObjectTransfer<'_>],
    direction: Direction,
) -> TransferReport {
    let span = tracing::info_span!("umbp.build", objects = objects.len());
    let mut status = BatchStatus::new(objects.len());
    {
        let _enter = span.enter();
        for (i, o) in objects.iter().enumerate() {
            // Batch-internal tags are positions, so results map back without a lookup.
            let tag = Tag::new(i as u32);
            if plan_object(builder, tag, o, direction).is_err() {
                // The object is reported below; its scope is gone either way.
                let _ = builder.rollback_object();
                let _ = status.set(tag, ObjectState::Rejected);
            }
        }
    }
    let plans = match builder.finish() {
        Ok(plans) => plans,
        Err(_) => {
            // Only an object left open can cause this, and every scope above was closed.
            return report(objects, status, Vec::new());
        }
    };
    let rejected = plans.rejected.clone();
    let Outcome { failures, plans } = composite.submit(plans);
    let span = tracing::info_span!("umbp.wait", failures = failures.len());
    let _enter = span.enter();
    let _ = status.settle(&rejected, &failures);
    builder.recycle(plans);
    report(objects, status, failures)
}

/// Checks one object's ranges and pages and pushes its fragments inside one object scope.
fn plan_object(
    builder: &mut CompositeBuilder<'_>,
    tag: Tag,
    o: &ObjectTransfer<'_>,
    direction: Direction,
) -> Result<(), PlanError> {
    check_ranges(o.ranges.iter().map(|r| (r.offset, r.len)), o.object.size)?;
    if direction == Direction::Offload {
        let covered: u64 = o.ranges.iter().map(|r| r.len).sum();
        if covered != o.object.size {
            // Sorted, disjoint and inside: they tile the object exactly when they add up to it.
            return Err(
                WalkError::RangePastEnd { offset: 0, len: covered, size: o.object.size }.into()
            );
        }
    }
    let walk = PageWalk::new(o.object.pages, o.object.page_size, o.object.size)?;
    builder.begin_object(tag)?;
    for r in o.ranges {
        walk.walk(r.offset, r.len, r.endpoint_offset, |page| {
            let f = match direction {
                Direction::Restore => Fragment::new(
                    o.object.tier,
                    page.tier_offset,
                    r.endpoint,
                    page.dst_offset,
                    page.len,
                    tag,
                ),
                Direction::Offload => Fragment::new(
                    r.endpoint,
                    page.dst_offset,
                    o.object.tier,
                    page.tier_offset,
                    page.len,
                    tag,
                ),
            };
            builder.push(f)
        })?;
    }
    builder.commit_object()
}

fn report(
    objects: &[ObjectTransfer<'_>],
    status: BatchStatus,
    failures: Vec<Failure>,
) -> TransferReport {
    let results = objects
        .iter()
        .zip(status.objects())
        .map(|(o, &state)| ObjectResult { tag: o.tag, state })
        .collect();
    TransferReport { objects: results, aggregate: status.aggregate(), failures }
}
