//! The batch planner: plan a finished list of fragments in two passes.
//!
//! This is the reference meaning of a plan set. Every incremental builder must produce exactly
//! what this produces over the fragments of its committed objects ("Equivalence" in the
//! workspace's docs/ARCHITECTURE.md).

use std::collections::{HashMap, HashSet};

use crate::rules::validate;
use crate::{EndpointTable, Fragment, Plan, PlanRules, PlanSet, Segment};

/// Plans `fragments` as one batch.
///
/// Pass one rejects every object with an invalid fragment (in order of its first invalid
/// fragment). Pass two appends the fragments of the other objects to one plan per endpoint pair,
/// extending a plan's last segment when source and destination are both exactly adjacent and
/// the result stays within the engine's maximum segment. A fragment longer than the maximum is
/// appended as consecutive pieces of the maximum length (the last one: the rest), each as a
/// fragment of its own (so none of them extends a segment). Zero-length fragments are skipped.
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
    // Tag starts so far, in every plan: their order (see `TagStart`).
    let mut starts = 0;
    for f in fragments.iter().filter(|f| f.len != 0 && !poisoned.contains(&f.tag)) {
        let index = *by_pair.entry((f.src, f.dst)).or_insert_with(|| {
            plans.push(Plan::new(f.src, f.dst, max_segment));
            plans.len() - 1
        });
        // A fragment past the maximum goes in as pieces of the maximum, the last one the rest.
        let mut done = 0;
        while done < f.len {
            let len = (f.len - done).min(max_segment);
            let piece =
                Segment { src_offset: f.src_offset + done, dst_offset: f.dst_offset + done, len };
            starts += u64::from(plans[index].append(piece, f.tag, starts));
            done += len;
        }
    }
    PlanSet {
        plans,
        rejected,
        reasons,
        deadline: None,
        stream: None,
        cancel: None,
        copy_hashes: None,
    }
}
