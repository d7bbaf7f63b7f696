//! The reconcile at start: the embedded index and its tier files made to agree after a crash
//! (or anything else that happened to the files while no process held them).
//!
//! What can disagree: the index keeps every block whose publish committed, but the bytes live
//! in a tier file it does not own. The file may be gone (deleted, a different disk mounted),
//! shorter than the blocks it should hold (truncated, recreated), reconfigured (fewer or other
//! slots), or hold other bytes (replaced by another file of the same size, a torn write after
//! a publish, bit rot). Strategy:
//!
//! - **At start, cheap and always**: the tier's shape against the one registered (a changed
//!   slot size or durability drops every block of the tier; fewer slots drop those past the
//!   end), and the file's length against every block's end (a missing file drops them all, a
//!   short one those past its end). No block is read.
//! - **At start, bounded**: [`Verify::Sample`] reads blocks spread over each tier, up to a
//!   byte budget, and checks their CRC32C; one mismatch means the file is not what the index
//!   describes (replaced, or damaged), and that tier is then verified whole.
//!   [`Verify::Full`] reads everything.
//! - **Lazily, on every load**: the pool verifies every block it loads against the CRC32C
//!   recorded at publish; a mismatch is a load error for that block and the pool removes its
//!   key, so it is not a hit again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::slots::{SlotState, TierState};
use super::{encode_spec, EmbeddedIndex, LOG, TIERS};
use crate::{Error, Placement, TierSpec};

/// Where a tier's bytes are: slot `s` of `spec` is bytes `base + s * slot_size ..` of the file
/// at `path`, as this process is configured now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierFile {
    /// The tier as configured now (its shape may differ from the one registered before).
    pub spec: TierSpec,
    /// The file holding its slots.
    pub path: PathBuf,
    /// Offset of slot 0 in the file.
    pub base: u64,
}

impl TierFile {
    /// Tier `spec` in the file at `path`, from its first byte.
    pub fn new(spec: TierSpec, path: impl Into<PathBuf>) -> Self {
        Self { spec, path: path.into(), base: 0 }
    }
}

/// How much [`EmbeddedIndex::reconcile`] reads.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Verify {
    /// No block is read: the tier's shape and the file's length only.
    Shape,
    /// The shape and length, then the CRC32C of blocks spread evenly over each tier, up to
    /// `max_bytes` of them per tier (at least one block); a tier in which one fails is then
    /// verified whole.
    Sample {
        /// Bytes read per tier, at most (unless a mismatch makes it verify the whole tier).
        max_bytes: u64,
    },
    /// Every block's CRC32C.
    Full,
}

/// Why [`EmbeddedIndex::reconcile`] dropped a block.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DropReason {
    /// The tier file is not there, or cannot be opened: `error` says why.
    FileMissing {
        /// The open's error.
        error: String,
    },
    /// The file ends before the block does (it was truncated, or recreated shorter).
    PastEnd {
        /// The file's length.
        file_len: u64,
    },
    /// The tier's slot size or durability is not the one registered: its slots are not where
    /// they were.
    Reshaped,
    /// The tier has fewer slots than when the block was published, and its slot is past them.
    Shrunk,
    /// The block's bytes do not match the CRC32C recorded at publish.
    ChecksumMismatch {
        /// CRC32C of the bytes read.
        actual: u32,
    },
    /// Reading the block failed: `error` says why.
    Unreadable {
        /// The read's error.
        error: String,
    },
}

/// One block the reconcile took out of the index, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// The block's placement as it was.
    pub placement: Placement,
    /// Why it is gone.
    pub reason: DropReason,
}

/// What [`EmbeddedIndex::reconcile`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Blocks of the tiers named that are still published.
    pub kept: u64,
    /// Of those, how many were read and matched their CRC32C.
    pub verified: u64,
    /// Bytes read to verify.
    pub bytes_read: u64,
    /// Tiers verified whole because a sampled block failed.
    pub escalated: u32,
    /// Every block taken out, with its reason.
    pub dropped: Vec<Dropped>,
}

/// One tier's published blocks at the snapshot: placement and log sequence number.
struct Snapshot {
    t: Option<usize>,
    registered: Option<TierSpec>,
    blocks: Vec<(Placement, u64)>,
}

impl EmbeddedIndex {
    /// Makes the index agree with its tier files: for each tier of `tiers` (durable tiers
    /// whose bytes are in files; tiers not named are left alone), drops every published block
    /// whose bytes cannot be what was published, and registers the tier's shape as it is now.
    /// Call it after [`open`](Self::open), before serving.
    ///
    /// What is checked: always, without reading a block, the tier's shape against the one
    /// registered and the file's length against every block's end (a missing file drops
    /// every block of the tier, a short one those past its end); with [`Verify::Sample`],
    /// the CRC32C of blocks spread over each tier up to a byte budget, and of the whole tier
    /// when one of them fails (the file was replaced or damaged); with [`Verify::Full`],
    /// every block. What is left to the loads: every load verifies its block's CRC32C anyway
    /// (the [`Pool`](crate::Pool) does), and a block that fails is removed then.
    ///
    /// Reading is done without holding the index, so lookups go on; blocks leased meanwhile
    /// are left to the loads' own verification.
    ///
    /// A tier whose slot size or durability changed loses every block, one with fewer slots
    /// those past its end; either needs no reservation or lease live on the tier
    /// ([`Error::InvalidConfig`] otherwise).
    ///
    /// Errors: [`Error::InvalidConfig`] (an invalid spec, a busy tier to reshape),
    /// [`Error::Store`] (the deletions could not be committed: nothing was dropped).
    pub fn reconcile(&self, tiers: &[TierFile], verify: Verify) -> Result<ReconcileReport, Error> {
        for tf in tiers {
            tf.spec.validate()?;
        }
        let snapshots: Vec<Snapshot> = {
            let state = self.read_state();
            tiers
                .iter()
                .map(|tf| {
                    let t = state.tier_index.get(&(tf.spec.node, tf.spec.tier)).copied();
                    let blocks = t
                        .map(|t| {
                            let mut b: Vec<(Placement, u64)> = state
                                .keys
                                .values()
                                .filter(|e| e.tier as usize == t)
                                .map(|e| {
                                    (
                                        state.placement_of(e),
                                        state.tiers[t].slots[e.slot as usize].seq,
                                    )
                                })
                                .collect();
                            b.sort_by_key(|(p, _)| p.slot);
                            b
                        })
                        .unwrap_or_default();
                    Snapshot { t, registered: t.map(|t| state.tiers[t].spec), blocks }
                })
                .collect()
        };
        let mut report = ReconcileReport::default();
        let mut drops: Vec<Vec<Dropped>> = Vec::with_capacity(tiers.len());
        for (tf, snap) in tiers.iter().zip(&snapshots) {
            drops.push(check_tier(tf, snap, verify, &mut report));
        }
        // Apply: one transaction for every deletion and tier record, then the state.
        let mut state = self.state();
        let mut plan: Vec<(usize, Vec<Dropped>)> = Vec::new();
        let txn = self.db.begin_write()?;
        {
            let mut log = txn.open_table(LOG)?;
            let mut specs = txn.open_table(TIERS)?;
            for ((tf, snap), dropped) in tiers.iter().zip(&snapshots).zip(drops) {
                let t = state.tier_index.get(&(tf.spec.node, tf.spec.tier)).copied();
                let registered = t.map(|t| state.tiers[t].spec);
                if registered != Some(tf.spec) {
                    specs.insert((tf.spec.node.0, tf.spec.tier.0), &encode_spec(&tf.spec)[..])?;
                }
                let Some(t) = t else { continue };
                let tier = &state.tiers[t];
                if reshaped(registered, &tf.spec) && (!idle(tier) || snap.t != Some(t)) {
                    return Err(Error::InvalidConfig(format!(
                        "tier {} of node {} cannot change shape while blocks of it are reserved or leased",
                        tf.spec.tier, tf.spec.node
                    )));
                }
                // Only what the slot still holds, unleased: a block removed, evicted or
                // leased since the snapshot is not this reconcile's to drop.
                let current: Vec<Dropped> = dropped
                    .into_iter()
                    .filter(|d| {
                        let p = &d.placement;
                        tier.slots.get(p.slot as usize).is_some_and(|s| {
                            s.generation == p.generation
                                && s.leases == 0
                                && matches!(s.state, SlotState::Published { key, .. } if key == p.key)
                        })
                    })
                    .collect();
                for d in &current {
                    log.remove(tier.slots[d.placement.slot as usize].seq)?;
                }
                plan.push((t, current));
            }
        }
        txn.commit()?;
        for (t, dropped) in plan {
            for d in &dropped {
                let slot = d.placement.slot;
                if state.tiers[t].pick(slot).is_some() {
                    state.tiers[t].left(slot);
                    state.keys.remove(&d.placement.key);
                }
            }
            report.dropped.extend(dropped);
        }
        for tf in tiers {
            let Some(&t) = state.tier_index.get(&(tf.spec.node, tf.spec.tier)) else {
                let t = state.tiers.len();
                state.tier_index.insert((tf.spec.node, tf.spec.tier), t);
                state.tiers.push(TierState::new(tf.spec));
                continue;
            };
            let registered = state.tiers[t].spec;
            if !reshaped(Some(registered), &tf.spec) {
                state.tiers[t].spec = tf.spec;
                continue;
            }
            // Another shape: a fresh slot table holding the survivors (every block past the
            // new shape was dropped above).
            let old = std::mem::replace(&mut state.tiers[t], TierState::new(tf.spec));
            for s in &old.slots {
                if let SlotState::Published { key, .. } = s.state {
                    let Some(p) = state.placement(&key) else {
                        debug_assert!(false, "a published slot's key is in the map");
                        continue;
                    };
                    let restored = state.tiers[t].restore(&p, s.seq);
                    debug_assert!(restored, "a survivor of the reshape fits");
                }
            }
            state.tiers[t].rebuild_free_list();
        }
        report.kept = snapshots
            .iter()
            .filter_map(|s| s.t)
            .map(|t| u64::from(state.tiers[t].stats().published))
            .sum();
        if !report.dropped.is_empty() {
            tracing::warn!(
                dropped = report.dropped.len(),
                kept = report.kept,
                "embedded index: reconcile dropped blocks whose bytes are not in their tier file"
            );
        }
        Ok(report)
    }
}

/// Whether `spec` puts the tier's slots elsewhere than `registered` (not only watermarks).
fn reshaped(registered: Option<TierSpec>, spec: &TierSpec) -> bool {
    registered.is_some_and(|r| spec.same_shape(&r).is_err())
}

fn idle(tier: &TierState) -> bool {
    tier.slots
        .iter()
        .all(|s| s.leases == 0 && matches!(s.state, SlotState::Free | SlotState::Published { .. }))
}

/// The blocks of one tier to drop, reading what `verify` says.
fn check_tier(
    tf: &TierFile,
    snap: &Snapshot,
    verify: Verify,
    report: &mut ReconcileReport,
) -> Vec<Dropped> {
    let mut out = Vec::new();
    let mut rest: Vec<Placement> = Vec::with_capacity(snap.blocks.len());
    let drop = |out: &mut Vec<Dropped>, p: Placement, reason: DropReason| {
        out.push(Dropped { placement: p, reason });
    };
    // The shape.
    for &(p, _) in &snap.blocks {
        match snap.registered {
            Some(r) if r.slot_size != tf.spec.slot_size || r.durable != tf.spec.durable => {
                drop(&mut out, p, DropReason::Reshaped)
            }
            _ if p.slot >= tf.spec.slot_count => drop(&mut out, p, DropReason::Shrunk),
            _ => rest.push(p),
        }
    }
    if rest.is_empty() {
        return out;
    }
    // The file and its length.
    let file = match File::open(&tf.path) {
        Ok(f) => f,
        Err(e) => {
            let error = format!("{}: {e}", tf.path.display());
            for p in rest {
                drop(&mut out, p, DropReason::FileMissing { error: error.clone() });
            }
            return out;
        }
    };
    let file_len = match file.metadata() {
        Ok(m) => m.len(),
        Err(e) => {
            for p in rest {
                drop(&mut out, p, DropReason::Unreadable { error: e.to_string() });
            }
            return out;
        }
    };
    let end = |p: &Placement| tf.base + tf.spec.slot_offset(p.slot) + p.len;
    let (fits, past): (Vec<Placement>, Vec<Placement>) =
        rest.into_iter().partition(|p| end(p) <= file_len);
    for p in past {
        drop(&mut out, p, DropReason::PastEnd { file_len });
    }
    // The bytes.
    let sample: Vec<usize> = match verify {
        Verify::Shape => Vec::new(),
        Verify::Full => (0..fits.len()).collect(),
        Verify::Sample { max_bytes } => {
            let total: u64 = fits.iter().map(|p| p.len).sum();
            let n = if total <= max_bytes {
                fits.len()
            } else {
                let avg = (total / fits.len().max(1) as u64).max(1);
                ((max_bytes / avg) as usize).clamp(1, fits.len())
            };
            // Evenly spread: the i-th of n at i * len / n.
            (0..n).map(|i| i * fits.len() / n.max(1)).collect()
        }
    };
    let mut buf = Vec::new();
    let mut bad = vec![false; fits.len()];
    let mut checked = vec![false; fits.len()];
    let mut check = |i: usize, out: &mut Vec<Dropped>, report: &mut ReconcileReport| -> bool {
        if checked[i] {
            return !bad[i];
        }
        checked[i] = true;
        let p = fits[i];
        buf.resize(p.len as usize, 0);
        let ok = match file.read_exact_at(&mut buf, tf.base + tf.spec.slot_offset(p.slot)) {
            Ok(()) => {
                report.bytes_read += p.len;
                let actual = crate::checksum(&buf);
                if actual == p.checksum {
                    report.verified += 1;
                    true
                } else {
                    out.push(Dropped {
                        placement: p,
                        reason: DropReason::ChecksumMismatch { actual },
                    });
                    false
                }
            }
            Err(e) => {
                out.push(Dropped {
                    placement: p,
                    reason: DropReason::Unreadable { error: e.to_string() },
                });
                false
            }
        };
        bad[i] = !ok;
        ok
    };
    let mut failed = false;
    for &i in &sample {
        failed |= !check(i, &mut out, report);
    }
    if failed && matches!(verify, Verify::Sample { .. }) {
        report.escalated += 1;
        for i in 0..fits.len() {
            check(i, &mut out, report);
        }
    }
    out
}
