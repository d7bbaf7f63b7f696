//! The batch planner: plan a finished list of fragments in two passes.
//!
//! This is the reference meaning of a plan set. Every incremental builder must produce exactly
//! what this produces over the fragments of its committed objects (DESIGN §4, "Equivalence").

use std::collections::{HashMap, HashSet};

use crate::plan::TagStart;
use crate::rules::validate;
use crate::{EndpointTable, Fragment, Plan, PlanRules, PlanSet, Segment};

/// Plans `fragments` as one batch.
///
/// Pass one rejects every object with an invalid fragment (in order of its first invalid
/// fragment). Pass two appends the fragments of the other objects to one plan per endpoint pair,
/// extending a plan's last segment when source and destination are both exactly adjacent and
/// the result stays within the engine's maximum segment. Zero-length fragments are skipped.
pub fn plan_batch<R: PlanRules + ?Sized>(
    rules: &R,
    table: &EndpointTable,
    fragments: &[Fragment],
) -> PlanSet {
    let mut poisoned = HashSet::new();
    let mut rejected = Vec::new();
    let mut reasons = Vec::new();
    for f in fragments.iter().filter(|f| f.len != 0) {
        if let Err(reason) = validate(rules, table, f) {
            if poisoned.insert(f.tag) {
                rejected.push(f.tag);
                reasons.push(reason);
            }
        }
    }

    let max_segment = rules.max_segment_len();
    let mut plans: Vec<Plan> = Vec::new();
    let mut by_pair = HashMap::new();
    for f in fragments.iter().filter(|f| f.len != 0 && !poisoned.contains(&f.tag)) {
        let index = *by_pair.entry((f.src, f.dst)).or_insert_with(|| {
            plans.push(Plan::new(f.src, f.dst));
            plans.len() - 1
        });
        append(&mut plans[index], f, max_segment);
    }
    PlanSet { plans, rejected, reasons, deadline: None, stream: None, cancel: None }
}

/// Appends a validated fragment to `plan`, merging into its last segment when allowed.
fn append(plan: &mut Plan, f: &Fragment, max_segment: u64) {
    let last = plan.segments.len().checked_sub(1);
    let merges = plan.segments.last().is_some_and(|s| {
        s.src_offset.checked_add(s.len) == Some(f.src_offset)
            && s.dst_offset.checked_add(s.len) == Some(f.dst_offset)
            && s.len.checked_add(f.len).is_some_and(|sum| sum <= max_segment)
    });
    let (segment, at) = match (merges, last, plan.segments.last_mut()) {
        (true, Some(i), Some(s)) => {
            let at = s.len;
            s.len += f.len;
            (i, at)
        }
        _ => {
            plan.segments.push(Segment {
                src_offset: f.src_offset,
                dst_offset: f.dst_offset,
                len: f.len,
            });
            (plan.segments.len() - 1, 0)
        }
    };
    if plan.tags.last() != Some(&f.tag) {
        plan.tags.push(f.tag);
        plan.tag_starts.push(TagStart { segment, at });
    }
}
