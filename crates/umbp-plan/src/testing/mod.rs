//! Test support for engine crates (feature `testing`): random fragment streams, a driver that
//! plays them into any [`PlanBuilder`], and a reference executor that copies fragment by
//! fragment over plain memory.
//!
//! The equivalence property every builder must pass reads:
//!
//! ```
//! # use umbp_plan::testing::{Scenario, ScenarioConfig, drive, ReferenceMemory};
//! # use umbp_plan::{Endpoint, EndpointRegistry, IncrementalBuilder, PlanRules, RulePlanner, BatchPlanner};
//! # struct HostOnly;
//! # impl PlanRules for HostOnly {
//! #     fn carries(&self, s: &Endpoint, d: &Endpoint) -> bool { s.is_host() && d.is_host() }
//! # }
//! let scenario = Scenario::generate(7, &ScenarioConfig::default());
//! let registry = EndpointRegistry::new();
//! // SAFETY: the plans are compared and executed by the reference executor only.
//! unsafe { scenario.register_invented(&registry) };
//! let mut builder = IncrementalBuilder::new(HostOnly, registry.clone());
//! let outcome = drive(&mut builder, &scenario).unwrap();
//! let expected = RulePlanner::new(HostOnly, registry).plan_batch(&outcome.committed);
//! assert_eq!(outcome.plans, expected);
//! ReferenceMemory::assert_same_bytes(&scenario, &outcome);
//! ```

use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;

use crate::{
    DeviceOrdinal, Endpoint, EndpointId, EndpointKind, EndpointRegistry, Error, Fragment,
    IncrementalBuilder, PlanBuilder, PlanRules, PlanSet, Tag,
};

/// Shapes of the random scenarios.
#[derive(Clone, Debug)]
pub struct ScenarioConfig {
    /// Kinds of the source endpoints; each destination receives from exactly one of them.
    pub sources: Vec<EndpointKind>,
    /// Kinds of the destination endpoints.
    pub destinations: Vec<EndpointKind>,
    /// Length of every endpoint in bytes.
    pub endpoint_len: u64,
    /// Largest fragment length.
    pub max_fragment: u64,
    /// Most objects in one scenario.
    pub max_objects: usize,
    /// Most fragments in one object.
    pub max_fragments: usize,
    /// Percent of fragments made invalid (out of bounds, overflowing, unknown endpoint).
    pub invalid_percent: u32,
}

impl Default for ScenarioConfig {
    /// Host sources and destinations plus one device destination (refused by host-only
    /// engines), 4 KiB endpoints, fragments up to 96 bytes, 5 % invalid fragments.
    fn default() -> Self {
        Self {
            sources: vec![EndpointKind::Host, EndpointKind::Host],
            destinations: vec![
                EndpointKind::Host,
                EndpointKind::Host,
                EndpointKind::Host,
                EndpointKind::Device(DeviceOrdinal::new(0)),
            ],
            endpoint_len: 4096,
            max_fragment: 96,
            max_objects: 24,
            max_fragments: 16,
            invalid_percent: 5,
        }
    }
}

/// How an object's scope ends.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ObjectEnd {
    /// `commit_object`.
    Commit,
    /// `rollback_object`.
    Rollback,
}

/// One object of a scenario: its fragments and how its scope ends.
#[derive(Clone, Debug)]
pub struct ScenarioObject {
    /// The object's tag (unique in the scenario).
    pub tag: Tag,
    /// Its fragments in push order.
    pub fragments: Vec<Fragment>,
    /// Commit or rollback.
    pub end: ObjectEnd,
}

/// A random batch: endpoints (ids `0 .. n` in order) and objects.
///
/// No endpoint is both a source and a destination, and every destination receives from a single
/// source, so executing plans pair by pair gives the same bytes as executing the fragments in
/// stream order.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Sources first, then destinations; register them in this order into a fresh registry.
    pub endpoints: Vec<Endpoint>,
    /// How many of `endpoints` are sources.
    pub sources: usize,
    /// The objects in order.
    pub objects: Vec<ScenarioObject>,
}

/// A splitmix64 generator: the scenario is a pure function of its seed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

impl Scenario {
    /// The scenario of `seed` under `config`.
    pub fn generate(seed: u64, config: &ScenarioConfig) -> Self {
        let mut rng = SplitMix(seed);
        let len = config.endpoint_len;
        let mut endpoints = Vec::new();
        for (i, kind) in config.sources.iter().chain(&config.destinations).enumerate() {
            let addr = 0x1000_0000 * (i as u64 + 1);
            endpoints.push(match *kind {
                EndpointKind::Host => Endpoint::host(addr, len),
                EndpointKind::Device(d) => Endpoint::device(d, addr, len),
                EndpointKind::File(f) => Endpoint::file(f.fd, f.file_offset, len, f.direct),
                EndpointKind::Remote(r) => Endpoint::remote(r, 0, len),
            });
        }
        let sources = config.sources.len().max(1);
        let destinations = config.destinations.len().max(1);
        let unknown = EndpointId::from_raw(endpoints.len() as u64 + 7);
        // Where the last fragment of each destination ended, to make adjacent follow-ups.
        let mut last_end: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
        let object_count = 1 + rng.below(config.max_objects.max(1) as u64) as usize;
        let mut objects = Vec::with_capacity(object_count);
        for t in 0..object_count {
            let tag = Tag::new(t as u32);
            let mut fragments = Vec::new();
            let mut d = rng.below(destinations as u64) as usize;
            for _ in 0..rng.below(config.max_fragments as u64 + 1) {
                if rng.below(100) < 30 {
                    d = rng.below(destinations as u64) as usize;
                }
                let mut src = EndpointId::from_raw((d % sources) as u64);
                let mut dst = EndpointId::from_raw((sources + d) as u64);
                let mut flen = 1 + rng.below(config.max_fragment.max(1));
                let roll = rng.below(100);
                let (mut src_offset, mut dst_offset) = match last_end.get(&d) {
                    Some(&(s, t)) if roll < 55 => (s, t),
                    _ => (
                        rng.below(len.saturating_sub(flen) + 1),
                        rng.below(len.saturating_sub(flen) + 1),
                    ),
                };
                if rng.below(100) < u64::from(config.invalid_percent) {
                    match rng.below(4) {
                        0 => src_offset = len - flen / 2,
                        1 => dst_offset = u64::MAX - flen / 2,
                        2 => src = unknown,
                        _ => dst = unknown,
                    }
                } else if rng.below(100) < 3 {
                    flen = 0;
                }
                let f = Fragment::new(src, src_offset, dst, dst_offset, flen, tag);
                if f.src_offset.checked_add(flen).is_some_and(|e| e <= len)
                    && f.dst_offset.checked_add(flen).is_some_and(|e| e <= len)
                {
                    last_end.insert(d, (f.src_offset + flen, f.dst_offset + flen));
                }
                fragments.push(f);
            }
            let end = if rng.below(100) < 25 { ObjectEnd::Rollback } else { ObjectEnd::Commit };
            objects.push(ScenarioObject { tag, fragments, end });
        }
        Self { endpoints, sources, objects }
    }

    /// Registers the endpoints, in order, with their invented addresses.
    ///
    /// # Safety
    ///
    /// The addresses are invented: plans built against them may be compared and run by the
    /// [`ReferenceMemory`], never submitted to an engine that dereferences them.
    #[allow(unsafe_code)]
    pub unsafe fn register_invented(&self, registry: &EndpointRegistry) -> Vec<EndpointId> {
        self.endpoints
            .iter()
            // SAFETY: the caller promises these endpoints never reach an engine's executor.
            .map(|e| unsafe { registry.register(*e) })
            .collect()
    }
}

/// Registers a file endpoint on descriptor number `fd`, open or not, for tests that plan
/// against files without opening any; nothing deregisters it but
/// [`EndpointRegistry::deregister`]. Real files go through [`Register::register_file`].
///
/// [`Register::register_file`]: crate::Register::register_file
pub fn invent_file(
    registry: &EndpointRegistry,
    fd: i32,
    file_offset: u64,
    len: u64,
    direct: bool,
) -> EndpointId {
    registry.insert(Endpoint::file(fd, file_offset, len, direct))
}

/// A proptest strategy for scenarios under `config`.
pub fn scenarios(config: ScenarioConfig) -> impl Strategy<Value = Scenario> {
    any::<u64>().prop_map(move |seed| Scenario::generate(seed, &config))
}

/// What [`drive`] produced: the builder's plan set and the fragments of committed objects.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// `finish()` of the builder.
    pub plans: PlanSet,
    /// Every fragment pushed inside a committed object, in push order.
    pub committed: Vec<Fragment>,
}

/// Plays `scenario` into `builder` and finishes it. Rejections are expected; any other error
/// (misuse of the builder) is returned.
pub fn drive(builder: &mut dyn PlanBuilder, scenario: &Scenario) -> Result<Outcome, Error> {
    play(builder, scenario, |builder, fragments| {
        for &f in fragments {
            match builder.push(f) {
                Ok(()) | Err(Error::Rejected { .. } | Error::ObjectRejected { .. }) => {}
                Err(other) => return Err(other),
            }
        }
        Ok(())
    })
}

/// Plays `scenario` into an incremental builder through its fast path: one
/// [`Run`](crate::Run) per stretch of fragments that share an endpoint pair. Rejections are
/// expected; any other error (misuse of the builder) is returned.
pub fn drive_runs<R: PlanRules>(
    builder: &mut IncrementalBuilder<R>,
    scenario: &Scenario,
) -> Result<Outcome, Error> {
    play(builder, scenario, |builder, fragments| {
        for stretch in fragments.chunk_by(|a, b| (a.src, a.dst) == (b.src, b.dst)) {
            let mut run = match builder.begin_run(stretch[0].src, stretch[0].dst) {
                Ok(run) => run,
                // Poisoned by an earlier stretch: the object is rejected.
                Err(Error::ObjectRejected { .. }) => continue,
                Err(other) => return Err(other),
            };
            for f in stretch {
                match run.push(f.src_offset, f.dst_offset, f.len) {
                    Ok(()) => {}
                    Err(Error::Rejected { .. } | Error::ObjectRejected { .. }) => break,
                    Err(other) => return Err(other),
                }
            }
        }
        Ok(())
    })
}

/// The object loop both drivers share: open each object, let `push` add its fragments, commit
/// or roll it back as the scenario says, and finish.
fn play<B: PlanBuilder + ?Sized>(
    builder: &mut B,
    scenario: &Scenario,
    mut push: impl FnMut(&mut B, &[Fragment]) -> Result<(), Error>,
) -> Result<Outcome, Error> {
    let mut committed = Vec::new();
    for object in &scenario.objects {
        builder.begin_object(object.tag)?;
        push(builder, &object.fragments)?;
        match object.end {
            ObjectEnd::Commit => {
                builder.commit_object()?;
                committed.extend_from_slice(&object.fragments);
            }
            ObjectEnd::Rollback => builder.rollback_object()?,
        }
    }
    Ok(Outcome { plans: builder.finish()?, committed })
}

/// Plain memory per endpoint, and two ways to run transfers over it: fragment by fragment (the
/// reference) and plan by plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReferenceMemory {
    buffers: BTreeMap<EndpointId, Vec<u8>>,
}

/// Byte `i` of the source pattern of endpoint `id`.
pub fn pattern_byte(id: EndpointId, i: u64) -> u8 {
    (i.wrapping_mul(31).wrapping_add(id.raw().wrapping_mul(101)) % 251) as u8
}

/// The value destinations hold before a transfer.
pub const POISON: u8 = 0xA5;

impl ReferenceMemory {
    /// Memory for `scenario`: sources hold [`pattern_byte`], destinations hold [`POISON`].
    pub fn for_scenario(scenario: &Scenario) -> Self {
        let mut buffers = BTreeMap::new();
        for (i, e) in scenario.endpoints.iter().enumerate() {
            let id = EndpointId::from_raw(i as u64);
            let bytes = if i < scenario.sources {
                (0..e.len()).map(|k| pattern_byte(id, k)).collect()
            } else {
                vec![POISON; e.len() as usize]
            };
            buffers.insert(id, bytes);
        }
        Self { buffers }
    }

    /// The bytes of endpoint `id`.
    pub fn get(&self, id: EndpointId) -> Option<&[u8]> {
        self.buffers.get(&id).map(Vec::as_slice)
    }

    /// Copies `len` bytes; `false` (and nothing copied) when either side is unknown or out of
    /// range.
    pub fn copy(
        &mut self,
        src: EndpointId,
        src_offset: u64,
        dst: EndpointId,
        dst_offset: u64,
        len: u64,
    ) -> bool {
        let Some(bytes) = self.range(src, src_offset, len).map(<[u8]>::to_vec) else {
            return false;
        };
        match self.buffers.get_mut(&dst).and_then(|b| {
            let start = usize::try_from(dst_offset).ok()?;
            b.get_mut(start..start.checked_add(bytes.len())?)
        }) {
            Some(out) => {
                out.copy_from_slice(&bytes);
                true
            }
            None => false,
        }
    }

    fn range(&self, id: EndpointId, offset: u64, len: u64) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        self.buffers.get(&id)?.get(start..end)
    }

    /// Runs `fragments` one by one, skipping those of the `rejected` objects.
    pub fn execute_fragments(&mut self, fragments: &[Fragment], rejected: &[Tag]) {
        let rejected: HashSet<Tag> = rejected.iter().copied().collect();
        for f in fragments.iter().filter(|f| !rejected.contains(&f.tag)) {
            self.copy(f.src, f.src_offset, f.dst, f.dst_offset, f.len);
        }
    }

    /// Runs every segment of every plan, plan by plan.
    pub fn execute_plans(&mut self, plans: &PlanSet) {
        for plan in plans.plans() {
            for s in plan.segments() {
                assert!(
                    self.copy(plan.src(), s.src_offset, plan.dst(), s.dst_offset, s.len),
                    "a planned segment lies outside its endpoints"
                );
            }
        }
    }

    /// Asserts that the plans of `outcome` write exactly the bytes its committed, non-rejected
    /// fragments write one by one.
    pub fn assert_same_bytes(scenario: &Scenario, outcome: &Outcome) {
        let mut by_fragment = Self::for_scenario(scenario);
        by_fragment.execute_fragments(&outcome.committed, outcome.plans.rejected());
        let mut by_plan = Self::for_scenario(scenario);
        by_plan.execute_plans(&outcome.plans);
        assert!(by_fragment == by_plan, "plans and fragments wrote different bytes");
    }
}

/// Whether what a test needs is here (`available` is `Ok`). Otherwise prints why the test
/// skips and returns false, or panics when the environment variable `require` is `1`: CI,
/// which installs every dependency, sets it (`UMBP_REQUIRE_UCX`, ...) so that a missing one
/// fails the run instead of skipping tests quietly.
pub fn available_or_skip<E: std::fmt::Display>(require: &str, available: Result<(), E>) -> bool {
    match available {
        Ok(()) => true,
        Err(e) => {
            assert!(std::env::var_os(require).is_none_or(|v| v != "1"), "{require}=1 but {e}");
            eprintln!("skipped: {e}");
            false
        }
    }
}

/// What an engine told a plan set's checksum sink: (object, piece, CRC32C) for each piece.
pub type CopyReports = Vec<(Tag, crate::Segment, u32)>;

/// Plans `fragments` with `engine`'s builder (an object per run of equal tags, every fragment
/// pushed and committed), submits the plan set with a checksum sink, and waits: the objects
/// that failed (sorted, each once) and what the sink was told. For testing engines that
/// [hash while copying](crate::TransferEngine::hashes_while_copying).
pub fn submit_hashed(
    engine: &dyn crate::TransferEngine,
    fragments: &[Fragment],
) -> (Vec<Tag>, CopyReports) {
    let mut builder = engine.builder();
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        builder.begin_object(group[0].tag).expect("a new object");
        for f in group {
            builder.push(*f).expect("a fragment the engine carries");
        }
        builder.commit_object().expect("an open object");
    }
    let mut plans = builder.finish().expect("every object committed");
    let reports = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&reports);
    plans.set_copy_hashes(Some(crate::checksum::CopyHashes::new(move |_, tag, piece, crc| {
        log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((tag, piece, crc));
    })));
    let mut failed: Vec<Tag> =
        engine.submit(plans).wait().iter().flat_map(|f| f.tags.iter().copied()).collect();
    failed.sort_unstable();
    failed.dedup();
    let reports = reports.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    (failed, reports)
}

/// Asserts what [`submit_hashed`] returned: every object of `fragments` not in `failed` was
/// reported exactly once per source byte (its pieces tile its fragments' source ranges, no
/// byte twice), each piece with the CRC32C of the bytes `source(offset, len)` returns from the
/// source endpoint. What failed objects reported is not looked at: an engine may report them
/// or not.
pub fn assert_hashed_once(
    fragments: &[Fragment],
    failed: &[Tag],
    reports: &[(Tag, crate::Segment, u32)],
    source: impl Fn(u64, u64) -> Vec<u8>,
) {
    /// Sorted runs, adjacent ones merged.
    fn merged(mut runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
        runs.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (at, len) in runs {
            match out.last_mut() {
                Some(last) if last.0 + last.1 == at => last.1 += len,
                _ => out.push((at, len)),
            }
        }
        out
    }
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        let tag = group[0].tag;
        if failed.contains(&tag) {
            continue;
        }
        let mine: Vec<_> = reports.iter().filter(|r| r.0 == tag).collect();
        let pieces = merged(mine.iter().map(|r| (r.1.src_offset, r.1.len)).collect());
        let want = merged(group.iter().map(|f| (f.src_offset, f.len)).collect());
        assert_eq!(pieces, want, "object {tag:?}: the pieces do not cover its bytes");
        let total: u64 = mine.iter().map(|r| r.1.len).sum();
        let bytes: u64 = want.iter().map(|w| w.1).sum();
        assert_eq!(total, bytes, "object {tag:?}: some bytes were reported twice");
        for &&(_, piece, crc) in &mine {
            let want = crc32c::crc32c(&source(piece.src_offset, piece.len));
            assert_eq!(crc, want, "object {tag:?}, piece {piece:?}: wrong CRC32C");
        }
    }
}
