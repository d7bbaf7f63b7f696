//! The device engine: planning rules, memory registration, and submit (kernel or copies).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use umbp_plan::{
    plan_batch, Completion, DeviceOrdinal, DeviceStream, Endpoint, EndpointId, EndpointPins,
    EndpointRegistry, EndpointRelease, EndpointTable, EngineError, FailedAt, Failure, FailureCause,
    Fragment, IncrementalBuilder, OverlapCheck, PlanBuilder, PlanRules, PlanSet, Register,
    RegisterError, Registration, Segment, Settled, Space, Tag, TransferEngine, TransferHandle,
};

use crate::descriptor::chunk_launches;
use crate::{
    Calibration, DeviceError, DeviceRuntime, Error, GatherDescriptor, LaunchTable, LayerEvents,
    Queue,
};

/// Tuning of the device engine. Every field has a documented default.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HbmConfig {
    /// A bucket uses the gather kernel only with at least this many fragments. Default 2.
    pub kernel_min_fragments: usize,
    /// ... and only when their mean size is under this many bytes. Default 128 KiB.
    pub kernel_max_mean_bytes: u64,
    /// Bytes one launch copies at most, so that a huge restore cannot occupy the whole GPU at
    /// once; longer buckets are split into several launches. Default 64 MiB.
    pub launch_max_bytes: u64,
    /// Pin every host endpoint registered through a composite for this device, so gathers can
    /// read and write it. Default `None` (host memory is pinned only by [`HbmEngine::pin`]).
    pub pin_registered_host: Option<DeviceOrdinal>,
    /// Calibrate every device when the engine starts ([`HbmEngine::calibrate`]: a fraction of
    /// a second per GPU), replacing [`kernel_max_mean_bytes`](Self::kernel_max_mean_bytes)
    /// with what the device measured. Default `false`, so that engines in tests and on the
    /// simulated device start at once; servers on real GPUs turn it on.
    pub calibrate: bool,
}

impl Default for HbmConfig {
    fn default() -> Self {
        Self {
            kernel_min_fragments: 2,
            kernel_max_mean_bytes: 128 << 10,
            launch_max_bytes: 64 << 20,
            pin_registered_host: None,
            calibrate: false,
        }
    }
}

/// The pairs the device engine carries: every pair of host and device memory with at least one
/// device endpoint (host to device, device to host, device to device). Host to host is the host
/// copy engine's, so the two never both claim a pair; files and remote regions are other
/// engines', and so is any kind added later (a side is carried only when it is one of these
/// two kinds, never for not being another).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HbmRules;

impl PlanRules for HbmRules {
    #[inline]
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        let memory = |e: &Endpoint| e.is_host() || e.device_ordinal().is_some();
        let device_side = src.device_ordinal().is_some() || dst.device_ordinal().is_some();
        device_side && memory(src) && memory(dst)
    }
}

/// The device engine over runtime `D`; see the [crate docs](crate).
pub struct HbmEngine<D: DeviceRuntime> {
    runtime: Arc<D>,
    registry: Arc<EndpointRegistry>,
    config: HbmConfig,
    /// Pinnings and allocations, shared with the registrations that release them.
    memory: Arc<Memory<D>>,
    /// Set once a synchronization after a launch failed: later submits use copies only.
    kernel_disabled: Arc<AtomicBool>,
    /// Gather launches so far.
    launches: AtomicU64,
    /// Buffers reused across submits: a submit takes one set (or makes one) and puts it back
    /// when its work is done, so concurrent submits never wait for each other's launches.
    /// Held under the lock only to take or return a set: a submit that held one lock through
    /// its launches made every other caller wait for them (a DRAM restore's 0.5 GiB launch
    /// stalled the staged route's second hops, and through them the SSD's reads).
    scratch: Mutex<Vec<Scratch>>,
    /// What calibration measured, per device; its threshold replaces the configured one.
    calibrations: Mutex<BTreeMap<DeviceOrdinal, Calibration>>,
}

/// One segment to move, by copy or (with `kernel`) by the gather kernel; when the submit
/// hashes, one object's piece of a segment.
#[derive(Copy, Clone, Debug)]
struct Job {
    plan: usize,
    segment: usize,
    /// When hashing: the piece's object, and where in the segment the piece starts.
    piece: Option<(Tag, u64)>,
    src: u64,
    dst: u64,
    len: u64,
}

/// An object's piece that was copied and hashed: what the plan set's sink is told.
#[derive(Copy, Clone, Debug)]
struct Hashed {
    plan: usize,
    tag: Tag,
    piece: Segment,
    crc: u32,
}

#[derive(Default)]
struct Bucket {
    /// Segments both of whose sides the device sees, with their kernel descriptor.
    kernel: Vec<(Job, GatherDescriptor)>,
    /// Segments only a copy can move.
    copies: Vec<Job>,
}

#[derive(Default)]
struct Scratch {
    buckets: BTreeMap<DeviceOrdinal, Bucket>,
    descriptors: Vec<GatherDescriptor>,
    table: LaunchTable,
    overlap: OverlapCheck,
    /// One launch's CRCs, one per descriptor, when hashing.
    crcs: Vec<u32>,
    /// The pieces hashed so far, reported once every bucket ran.
    hashed: Vec<Hashed>,
}

/// What the engine holds for endpoints: host memory pinned for a device and device memory it
/// allocated. Registrations through the engine release it ([`EndpointRelease`]) when they end.
struct Memory<D> {
    runtime: Arc<D>,
    /// Host endpoints whose end the engine hears of: registered through it (its release) or
    /// through a composite holding it ([`TransferEngine::endpoint_deregistering`]). Only
    /// these may be pinned, so no pinning outlives its registration. Locked before `pinned`.
    followed: Mutex<HashSet<EndpointId>>,
    /// Host endpoints pinned for a device: (device, device-visible alias, host address).
    pinned: Mutex<HashMap<EndpointId, (DeviceOrdinal, u64, u64)>>,
    /// Device memory this engine allocated: (device, address).
    owned: Mutex<HashMap<EndpointId, (DeviceOrdinal, u64)>>,
    /// How many submits whose work is not complete use each pinned endpoint (by its alias in
    /// a gather, or by DMA in a copy): [`Running`] holds the counts, `unpin` waits for zero.
    in_use: Mutex<HashMap<EndpointId, usize>>,
    /// Signalled when a count of `in_use` drops to zero.
    unused: Condvar,
}

/// The pinned endpoints one submit uses, from its start until its work is complete (it
/// synchronized, or the event after it on a caller's stream completed). Owned, so a pending
/// transfer handle can hold it. Only the pinnings it names wait for it: a submit never waits
/// for a release, so a lane holding several pending handles cannot deadlock with an `unpin`.
struct Running<D: DeviceRuntime> {
    memory: Arc<Memory<D>>,
    uses: Vec<EndpointId>,
}

impl<D: DeviceRuntime> Drop for Running<D> {
    fn drop(&mut self) {
        if self.uses.is_empty() {
            return;
        }
        let mut in_use = lock(&self.memory.in_use);
        let mut freed = false;
        for id in &self.uses {
            if let Some(n) = in_use.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    in_use.remove(id);
                    freed = true;
                }
            }
        }
        if freed {
            self.memory.unused.notify_all();
        }
    }
}

impl<D: DeviceRuntime> Memory<D> {
    /// Marks the pinned endpoints among `ids` in use by a submit. The caller holds the lock of
    /// `pinned` (`pinned` here), so an `unpin` either took the endpoint out before (and this
    /// submit does not see it pinned) or waits for this submit.
    fn enter(
        self: &Arc<Self>,
        pinned: &HashMap<EndpointId, (DeviceOrdinal, u64, u64)>,
        ids: impl IntoIterator<Item = EndpointId>,
    ) -> Running<D> {
        let mut uses: Vec<EndpointId> =
            ids.into_iter().filter(|id| pinned.contains_key(id)).collect();
        uses.sort_unstable();
        uses.dedup();
        if !uses.is_empty() {
            let mut in_use = lock(&self.in_use);
            for &id in &uses {
                *in_use.entry(id).or_default() += 1;
            }
        }
        Running { memory: Arc::clone(self), uses }
    }

    /// Starts following host endpoint `id`: the engine was told it was registered, and will
    /// be told when it ends.
    fn follow(&self, id: EndpointId, endpoint: &Endpoint) {
        if endpoint.is_host() {
            lock(&self.followed).insert(id);
        }
    }

    /// Pins followed host endpoint `endpoint` for `device`; refuses one the engine does not
    /// follow (its pinning would outlive its registration).
    fn pin_followed(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
        device: DeviceOrdinal,
    ) -> Result<(), Error> {
        // Held while pinning: `forget` stops following before it looks for a pinning, so it
        // either finds this one or this refuses.
        let followed = lock(&self.followed);
        if !followed.contains(&id) {
            return Err(Error::UnknownEndpoint(id));
        }
        self.pin(id, endpoint, device)
    }

    /// Pins registered host endpoint `endpoint` for `device`, so gathers can use it.
    fn pin(&self, id: EndpointId, endpoint: &Endpoint, device: DeviceOrdinal) -> Result<(), Error> {
        let mut pinned = lock(&self.pinned);
        if pinned.contains_key(&id) {
            return Ok(());
        }
        // SAFETY: the endpoint's registration promised this memory valid until deregistered,
        // and what ends a registration unpins it first (`forget`).
        let alias = unsafe { self.runtime.register_host(device, endpoint.addr(), endpoint.len())? };
        pinned.insert(id, (device, alias, endpoint.addr()));
        Ok(())
    }

    /// Undoes `pin`: later submits no longer see the endpoint pinned (they copy it), and the
    /// pinning goes once the submits that use it have completed.
    fn unpin(&self, id: EndpointId) -> Result<(), Error> {
        let pinned = lock(&self.pinned).remove(&id);
        let (device, _, addr) = pinned.ok_or(Error::UnknownEndpoint(id))?;
        let mut in_use = lock(&self.in_use);
        while in_use.contains_key(&id) {
            in_use = self.unused.wait(in_use).unwrap_or_else(PoisonError::into_inner);
        }
        drop(in_use);
        // SAFETY: pinned by `pin`, and unpinned once (removed from `pinned` above); no submit
        // that saw it pinned still has work queued (`in_use` is clear), and later ones no longer
        // see it.
        unsafe { self.runtime.unregister_host(device, addr)? };
        Ok(())
    }

    /// Frees memory from `alloc_device` whose endpoint is already deregistered.
    fn release_owned(&self, id: EndpointId) -> Result<(), Error> {
        let (device, addr) = lock(&self.owned).remove(&id).ok_or(Error::UnknownEndpoint(id))?;
        // SAFETY: allocated by `alloc_device`, removed from `owned` so freed once. Every submit
        // that used it pinned its endpoint in the registry and holds that pin until its work is
        // complete (synchronized, or its stream event reached); the deregistration that led
        // here waited for those pins, and no later submit can resolve the endpoint.
        unsafe { self.runtime.free(device, addr)? };
        Ok(())
    }

    /// What follows a deregistration: stop following, unpin, free.
    fn forget(&self, id: EndpointId) -> Result<(), Error> {
        lock(&self.followed).remove(&id);
        if lock(&self.pinned).contains_key(&id) {
            self.unpin(id)?;
        }
        if lock(&self.owned).contains_key(&id) {
            self.release_owned(id)?;
        }
        Ok(())
    }
}

impl<D: DeviceRuntime> EndpointRelease for Memory<D> {
    fn release(&self, id: EndpointId) {
        if let Err(error) = self.forget(id) {
            tracing::warn!(id = id.raw(), %error, "could not release a deregistered endpoint");
        }
    }
}

impl<D: DeviceRuntime> HbmEngine<D> {
    /// An engine over `runtime` that names endpoints in `registry`.
    pub fn new(runtime: Arc<D>, registry: Arc<EndpointRegistry>, config: HbmConfig) -> Self {
        let memory = Arc::new(Memory {
            runtime: Arc::clone(&runtime),
            followed: Mutex::new(HashSet::new()),
            pinned: Mutex::new(HashMap::new()),
            owned: Mutex::new(HashMap::new()),
            in_use: Mutex::new(HashMap::new()),
            unused: Condvar::new(),
        });
        let engine = Self {
            runtime,
            registry,
            config,
            memory,
            kernel_disabled: Arc::new(AtomicBool::new(false)),
            launches: AtomicU64::new(0),
            scratch: Mutex::new(Vec::new()),
            calibrations: Mutex::new(BTreeMap::new()),
        };
        if config.calibrate {
            let devices = engine.runtime.device_count().unwrap_or(0);
            for device in (0..devices).map(DeviceOrdinal::new) {
                if let Err(error) = engine.calibrate(device) {
                    tracing::warn!(device = device.get(), %error, "calibration failed; keeping the configured threshold");
                }
            }
        }
        engine
    }

    /// Measures, on `device`, the gather kernel against one copy per fragment at a few
    /// fragment sizes (pinned host to device, [`CALIBRATION_BYTES`](crate::CALIBRATION_BYTES)
    /// each, best of three), and from then on sends a bucket on that device through the kernel
    /// only when its mean fragment is under the size the device chose
    /// ([`Calibration::kernel_max_mean_bytes`]). Returns what it measured; so does
    /// [`calibrations`](Self::calibrations) later. Runs alongside submits, which it only slows.
    pub fn calibrate(&self, device: DeviceOrdinal) -> Result<Calibration, Error> {
        let calibration =
            crate::calibrate::measure(&*self.runtime, device, 3, self.config.launch_max_bytes)?;
        tracing::info!(
            device = device.get(),
            kernel_max_mean_bytes = calibration.kernel_max_mean_bytes,
            "calibrated the gather kernel against copies"
        );
        lock(&self.calibrations).insert(device, calibration.clone());
        Ok(calibration)
    }

    /// Every device's calibration so far, by device: the engine's measured thresholds.
    pub fn calibrations(&self) -> Vec<Calibration> {
        lock(&self.calibrations).values().cloned().collect()
    }

    /// The mean fragment size under which a bucket on `device` uses the kernel: the device's
    /// calibration if it has one, else the configuration's.
    pub fn kernel_max_mean_bytes(&self, device: DeviceOrdinal) -> u64 {
        lock(&self.calibrations)
            .get(&device)
            .map_or(self.config.kernel_max_mean_bytes, |c| c.kernel_max_mean_bytes)
    }

    /// The device runtime.
    pub fn runtime(&self) -> &Arc<D> {
        &self.runtime
    }

    /// The registry the engine names endpoints in.
    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.registry
    }

    /// The configuration.
    pub fn config(&self) -> HbmConfig {
        self.config
    }

    /// Gather-kernel launches so far (one per bucket chunk).
    pub fn launches(&self) -> u64 {
        // Relaxed: a statistic; the launches it counts were ordered by the submit that did them.
        self.launches.load(Ordering::Relaxed)
    }

    /// Whether the gather kernel is still in use (a failed synchronization after a launch
    /// disables it for the engine's lifetime).
    pub fn kernel_enabled(&self) -> bool {
        !self.kernel_disabled.load(Ordering::Relaxed)
    }

    /// An incremental builder for this engine, as a concrete type (for
    /// [`begin_run`](IncrementalBuilder::begin_run) and `push_walk`).
    pub fn incremental_builder(&self) -> IncrementalBuilder<HbmRules> {
        IncrementalBuilder::new(HbmRules, self.registry.clone())
    }

    /// One event per layer group on `stream`, for a batch queued there: give it to the
    /// composite builder as the group listener with the same stream. See [`LayerEvents`].
    pub fn layer_events(&self, stream: DeviceStream) -> Arc<LayerEvents<D>> {
        LayerEvents::new(Arc::clone(&self.runtime), stream)
    }

    /// Allocates `len` bytes on `device` and registers them; the memory is freed when the
    /// registration ends (after the batches that use it). The device address is
    /// `registration.endpoint().addr()`.
    pub fn alloc_device(&self, device: DeviceOrdinal, len: u64) -> Result<Registration, Error> {
        let addr = self.runtime.alloc(device, len)?;
        // SAFETY: fresh device memory of `len` bytes, freed only by the registration's release
        // (below: it is in `owned` before the registration can end).
        let registered = unsafe { self.register_raw_memory(Endpoint::device(device, addr, len)) };
        match registered {
            Ok(registration) => {
                lock(&self.memory.owned).insert(registration.id(), (device, addr));
                Ok(registration)
            }
            Err(_) => {
                // Only a region that wraps the address space is refused here (the engine's
                // preparation pins host memory only).
                // SAFETY: allocated just above and never registered.
                unsafe { self.runtime.free(device, addr)? };
                Err(Error::BadRegion { addr, len })
            }
        }
    }

    /// Pins registered host endpoint `id` for `device`, so gathers can read and write it
    /// (unpinned host memory moves by copies). Registrations through the engine pin host
    /// memory by themselves when [`HbmConfig::pin_registered_host`] names a device. The pin
    /// goes when the registration ends (or at [`unpin`](Self::unpin)).
    ///
    /// Only host memory registered through this engine, or through a composite that holds it
    /// (which tells it of the registration and of its end), can be pinned: the engine hears
    /// when that registration ends and unpins. Memory registered elsewhere (the registry
    /// alone, another engine) is refused with [`Error::UnknownEndpoint`]: its pinning would
    /// outlive it, keeping freed memory pinned and refusing a later pin of the same bytes.
    pub fn pin(&self, id: EndpointId, device: DeviceOrdinal) -> Result<(), Error> {
        let endpoint = self.registry.get(id).filter(Endpoint::is_host);
        let endpoint = endpoint.ok_or(Error::UnknownEndpoint(id))?;
        self.memory.pin_followed(id, &endpoint, device)
    }

    /// Undoes [`pin`](Self::pin); the endpoint stays registered and moves by copies. Waits
    /// for the submits running now, which may be using the pinned alias.
    pub fn unpin(&self, id: EndpointId) -> Result<(), Error> {
        self.memory.unpin(id)
    }

    /// Sorts every segment of `plans` into per-device buckets, kernel-capable or copy-only
    /// (when `hashing`, each object's piece of a segment apart); returns the guard that keeps
    /// the pinnings it uses until the work is complete.
    fn bucket(
        &self,
        plans: &PlanSet,
        table: &EndpointTable,
        hashing: bool,
        scratch: &mut Scratch,
        failed: &mut Vec<Failed>,
    ) -> Running<D> {
        let pinned = lock(&self.memory.pinned);
        let running = self.memory.enter(&pinned, plans.endpoints());
        for (pi, plan) in plans.plans().iter().enumerate() {
            let (Some(&src), Some(&dst)) = (table.get(plan.src()), table.get(plan.dst())) else {
                let gone = if table.get(plan.src()).is_none() { plan.src() } else { plan.dst() };
                failed.push(Failed::plan(pi, FailureCause::EndpointGone(gone)));
                continue;
            };
            let Some(device) = dst
                .device_ordinal()
                .or(src.device_ordinal())
                .filter(|_| HbmRules.carries(&src, &dst))
            else {
                failed
                    .push(Failed::plan(pi, FailureCause::NotAccepted("not a device pair".into())));
                continue;
            };
            // The addresses the kernel would use: device memory of this device, or host memory
            // pinned for it (through its alias). Anything else moves by copy.
            let visible = |id: EndpointId, e: &Endpoint| match e.device_ordinal() {
                Some(d) => (d == device).then_some(e.addr()),
                None => pinned.get(&id).filter(|p| p.0 == device).map(|p| p.1),
            };
            let kernel_bases = visible(plan.src(), &src).zip(visible(plan.dst(), &dst));
            let bucket = scratch.buckets.entry(device).or_default();
            for (si, s) in plan.segments().iter().enumerate() {
                // The plan was checked against these endpoints; check again against the ones
                // registered now, so that nothing is ever written outside a destination.
                if !src.contains(s.src_offset, s.len) || !dst.contains(s.dst_offset, s.len) {
                    let cause = FailureCause::NotAccepted("segment outside its endpoints".into());
                    failed.push(Failed::segment(pi, si, cause));
                    continue;
                }
                let mut push = |piece: Option<(Tag, u64)>, len: u64| {
                    let at = piece.map_or(0, |(_, at)| at);
                    let (so, dof) = (s.src_offset + at, s.dst_offset + at);
                    let job = Job {
                        plan: pi,
                        segment: si,
                        piece,
                        src: src.addr() + so,
                        dst: dst.addr() + dof,
                        len,
                    };
                    match kernel_bases {
                        Some((ks, kd)) => bucket
                            .kernel
                            .push((job, GatherDescriptor { src: ks + so, dst: kd + dof, len })),
                        None => bucket.copies.push(job),
                    }
                };
                if hashing {
                    match plan.segment_tags(si) {
                        // The usual case: the whole segment is one object's.
                        &[tag] => push(Some((tag, 0)), s.len),
                        _ => {
                            for (tag, p) in plan.segment_pieces(si) {
                                push(Some((tag, p.src_offset - s.src_offset)), p.len);
                            }
                        }
                    }
                } else {
                    push(None, s.len);
                }
            }
        }
        running
    }

    /// Moves one device's bucket on `queue`; records the jobs that failed with their cause.
    /// On the engine's own queue it also synchronizes (and so settles the bucket); on a
    /// caller's stream it only queues, and returns whether a gather launch was queued.
    ///
    /// With `hashed` (a submit that hashes), every job moves by the runtime's hashing calls and
    /// its CRC goes into `hashed`, except what a launch that failed copied: its jobs are
    /// copied again, and hashed again.
    #[allow(clippy::too_many_arguments)] // The submit's scratch, split so the borrows stay disjoint.
    fn run_bucket(
        &self,
        plans: &PlanSet,
        device: DeviceOrdinal,
        bucket: &Bucket,
        queue: Queue,
        (descriptors, table, crcs): (&mut Vec<GatherDescriptor>, &mut LaunchTable, &mut Vec<u32>),
        mut hashed: Option<&mut Vec<Hashed>>,
        failed: &mut Vec<Failed>,
    ) -> bool {
        let fail_all = |failed: &mut Vec<_>, e: &DeviceError| {
            let jobs = bucket.copies.iter().chain(bucket.kernel.iter().map(|(j, _)| j));
            failed
                .extend(jobs.map(|j| Failed::segment(j.plan, j.segment, device_cause(device, e))));
        };
        if let Err(e) = self.runtime.set_device(device) {
            fail_all(failed, &e);
            return false;
        }
        let n = bucket.kernel.len();
        let bytes: u64 = bucket.kernel.iter().map(|(j, _)| j.len).sum();
        let by_kernel = self.kernel_enabled()
            && n >= self.config.kernel_min_fragments
            && bytes < self.kernel_max_mean_bytes(device).saturating_mul(n as u64);
        let mut launched = false;
        // Where the launches' CRCs start in `hashed`: dropped if their jobs are copied again.
        let launch_hashes = hashed.as_ref().map_or(0, |h| h.len());
        if by_kernel {
            descriptors.clear();
            descriptors.extend(bucket.kernel.iter().map(|(_, d)| *d));
            // The job and the offset in it where the next launched descriptor starts
            // (`chunk_launches` cuts descriptors in order, and no job is empty).
            let mut next = (0, 0);
            let launch = chunk_launches(descriptors, self.config.launch_max_bytes, table, |t| {
                // The launch's conditions hold: every descriptor side is device memory of
                // `device` or host memory pinned for it, inside its endpoint (checked in
                // `bucket`); endpoints stay valid until this submit's work is complete (its pins
                // and `Running` are held until then); the overlap check left no destination
                // overlapping a source or another destination; a caller's stream is live
                // (`DeviceStream::new`'s contract).
                match hashed.as_deref_mut() {
                    // SAFETY: the launch's conditions (above).
                    None => unsafe { self.runtime.gather(device, t, queue)? },
                    Some(hashed) => {
                        crcs.clear();
                        crcs.resize(t.descriptors.len(), 0);
                        // SAFETY: the launch's conditions (above); `crcs` holds one CRC per
                        // descriptor.
                        unsafe { self.runtime.gather_hashed(device, t, queue, crcs)? };
                        for (d, &crc) in t.descriptors.iter().zip(crcs.iter()) {
                            let (k, at) = next;
                            let job = &bucket.kernel[k].0;
                            hashed.extend(hash_of(plans, job, at, d.len, crc));
                            next = if at + d.len == job.len { (k + 1, 0) } else { (k, at + d.len) };
                        }
                    }
                }
                // Relaxed: a statistic.
                self.launches.fetch_add(1, Ordering::Relaxed);
                Ok::<(), DeviceError>(())
            });
            match launch {
                Ok(()) => launched = true,
                Err(e) => {
                    if let Some(hashed) = hashed.as_deref_mut() {
                        hashed.truncate(launch_hashes);
                    }
                    tracing::warn!(device = device.get(), error = %e, "gather launch failed; copying the bucket");
                }
            }
        }
        let launch_hashes_end = hashed.as_ref().map_or(0, |h| h.len());
        let copy = |jobs: &mut dyn Iterator<Item = &Job>,
                    hashed: &mut Option<&mut Vec<Hashed>>,
                    failed: &mut Vec<Failed>| {
            for j in jobs {
                // The copy's conditions hold: both sides lie inside their registered endpoints
                // (checked in `bucket`), valid until this submit's work is complete; a caller's
                // stream is live.
                let copied = match hashed.as_deref_mut() {
                    // SAFETY: the copy's conditions (above).
                    None => unsafe { self.runtime.copy(device, j.dst, j.src, j.len, queue) },
                    Some(hashed) => {
                        // SAFETY: the copy's conditions (above).
                        let crc =
                            unsafe { self.runtime.copy_hashed(device, j.dst, j.src, j.len, queue) };
                        crc.map(|crc| hashed.extend(hash_of(plans, j, 0, j.len, crc)))
                    }
                };
                if let Err(e) = copied {
                    self.recopy_per_object(plans, device, j, queue, e, failed);
                }
            }
        };
        copy(&mut bucket.copies.iter(), &mut hashed, failed);
        if !launched {
            copy(&mut bucket.kernel.iter().map(|(j, _)| j), &mut hashed, failed);
        }
        if queue != Queue::Own {
            return launched;
        }
        if let Err(e) = self.runtime.synchronize(device) {
            if !launched {
                fail_all(failed, &e);
                return false;
            }
            // The kernel's results cannot be trusted: stop using it, and move its jobs again by
            // copies.
            if !self.kernel_disabled.swap(true, Ordering::Relaxed) {
                tracing::error!(device = device.get(), error = %e, "synchronization after a gather launch failed; the gather kernel is disabled for this engine");
            }
            if let Some(hashed) = hashed.as_deref_mut() {
                hashed.drain(launch_hashes..launch_hashes_end);
            }
            copy(&mut bucket.kernel.iter().map(|(j, _)| j), &mut hashed, failed);
            if let Err(e) = self.runtime.synchronize(device) {
                fail_all(failed, &e);
            }
        }
        launched
    }
}

impl<D: DeviceRuntime> HbmEngine<D> {
    /// Job `j`'s copy failed with `error`. A segment that carries several objects is copied
    /// again object by object, so only the objects whose bytes still do not arrive fail; a
    /// segment of one object fails it.
    fn recopy_per_object(
        &self,
        plans: &PlanSet,
        device: DeviceOrdinal,
        j: &Job,
        queue: Queue,
        error: DeviceError,
        failed: &mut Vec<Failed>,
    ) {
        let plan = &plans.plans()[j.plan];
        let segment = plan.segments()[j.segment];
        if let Some((tag, _)) = j.piece {
            // Already one object's piece.
            let cause = device_cause(device, &error);
            failed.push(Failed { at: FailedAt::share(j.plan, j.segment, tag), cause });
            return;
        }
        if plan.segment_tags(j.segment).len() < 2 {
            failed.push(Failed::segment(j.plan, j.segment, device_cause(device, &error)));
            return;
        }
        for (tag, piece) in plan.segment_pieces(j.segment) {
            let at = piece.src_offset - segment.src_offset;
            // SAFETY: a sub-range of the job's two ranges (which lie inside their endpoints,
            // valid until this submit's work is complete); a caller's stream is live.
            let copied =
                unsafe { self.runtime.copy(device, j.dst + at, j.src + at, piece.len, queue) };
            if let Err(e) = copied {
                let cause = device_cause(device, &e);
                failed.push(Failed { at: FailedAt::share(j.plan, j.segment, tag), cause });
            }
        }
    }
}

/// The CRC32C `crc` of `len` bytes of `job`, from `at` bytes into it, as the plan set's sink
/// takes it; `None` for a job of a submit that does not hash.
fn hash_of(plans: &PlanSet, job: &Job, at: u64, len: u64, crc: u32) -> Option<Hashed> {
    let (tag, start) = job.piece?;
    let s = plans.plans()[job.plan].segments()[job.segment];
    let offset = start + at;
    let piece =
        Segment { src_offset: s.src_offset + offset, dst_offset: s.dst_offset + offset, len };
    Some(Hashed { plan: job.plan, tag, piece, crc })
}

/// A failure before it is mapped to the objects it costs.
struct Failed {
    at: FailedAt,
    cause: FailureCause,
}

impl Failed {
    fn plan(plan: usize, cause: FailureCause) -> Self {
        Self { at: FailedAt::plan(plan), cause }
    }

    fn segment(plan: usize, segment: usize, cause: FailureCause) -> Self {
        Self { at: FailedAt::segment(plan, segment), cause }
    }
}

/// Memory registers as everywhere else ([`Register`]). Host memory is pinned for
/// [`HbmConfig::pin_registered_host`] when set; the pinning (and the device memory of
/// [`alloc_device`](HbmEngine::alloc_device)) goes when the registration ends.
impl<D: DeviceRuntime> Register for HbmEngine<D> {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.registry
    }

    fn prepare(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        self.endpoint_registered(id, endpoint)
            .map_err(|source| RegisterError::Engine { engine: self.name().to_owned(), source })?;
        Ok(Some(Arc::clone(&self.memory) as Arc<dyn EndpointRelease>))
    }
}

impl<D: DeviceRuntime> TransferEngine for HbmEngine<D> {
    fn name(&self) -> &str {
        "hbm"
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        HbmRules.carries(src, dst)
    }

    /// Where the runtime copies on the CPU (the simulated device): its launches and copies
    /// hash what they copy, each object's piece of a segment apart.
    fn hashes_while_copying(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.runtime.hashes_while_copying() && HbmRules.carries(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(&HbmRules, &self.registry.snapshot(), fragments)
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        Box::new(self.incremental_builder())
    }

    /// Follows host endpoints (so [`HbmEngine::pin`] may pin them), and pins them for
    /// [`HbmConfig::pin_registered_host`], if set.
    fn endpoint_registered(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), EngineError> {
        self.memory.follow(id, endpoint);
        match self.config.pin_registered_host {
            Some(device) if endpoint.is_host() => {
                self.memory.pin(id, endpoint, device).inspect_err(|_| {
                    // Refused: nobody tells this engine of an end now.
                    lock(&self.memory.followed).remove(&id);
                })?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Stops following the endpoint, unpins it if this engine pinned it (and frees it if this
    /// engine allocated it).
    fn endpoint_deregistering(&self, id: EndpointId) {
        self.memory.release(id);
    }

    /// Moves every segment of `plans`, per device: one gather launch per chunk of a bucket of
    /// many small fragments, one copy per segment otherwise; then synchronizes each device and
    /// restores the caller's current device. The handle is settled on return.
    ///
    /// With a [stream](PlanSet::stream), the bucket of the stream's device is queued on that
    /// stream instead, nothing waits for it, and the handle is pending until an event the
    /// engine records after it completes: work the caller queues on the stream afterwards runs
    /// after these bytes landed. Until then the handle holds the endpoints (no registration
    /// ends, nothing is unpinned or freed). A device fault the event reports fails every
    /// object with bytes in that bucket (which of their bytes landed is unknown), and, if a
    /// gather ran there, disables the kernel as a failed synchronization does. Buckets of
    /// other devices run on the engine's queues as without a stream.
    ///
    /// First the overlap rule ([`OverlapCheck`]): objects whose bytes another fragment of the
    /// submit writes (or that write what another reads) fail with [`FailureCause::Overlap`]
    /// and never reach a launch or a copy, so no kernel ever runs over descriptors whose
    /// destinations overlap a source or each other.
    fn submit(&self, mut plans: PlanSet) -> TransferHandle {
        // Copies and launches are not cancelled once queued: the deadline is checked here.
        if plans.expired() {
            let failures = plans.fail_all(self.name(), FailureCause::TimedOut);
            return TransferHandle::settled(failures, plans);
        }
        // Pinned before any lookup: a deregistration waits for this submit, and `running` (from
        // `bucket`) keeps the pinnings it uses until its work is complete.
        let pins = self.registry.pin(plans.endpoints());
        let running;
        let table = Arc::clone(pins.table());
        let caller_device = self.runtime.current_device().ok();
        let stream = plans.stream();
        let mut failed = Vec::new();
        let mut on_stream = None;
        let overlapping;
        {
            // This submit's own buffers: no lock is held while its work runs.
            let mut taken = lock(&self.scratch).pop().unwrap_or_default();
            let scratch = &mut taken;
            overlapping = scratch.overlap.exclude(&mut plans, self.name(), |id| {
                let e = table.get(id)?;
                match e.device_ordinal() {
                    Some(d) => Some((Space::Device(d), e.addr())),
                    None => e.is_host().then_some((Space::Host, e.addr())),
                }
            });
            scratch.buckets.values_mut().for_each(|b| {
                b.kernel.clear();
                b.copies.clear();
            });
            // A runtime that copies on the CPU hashes what it copies for a sink.
            let sink = plans.copy_hashes().filter(|_| self.runtime.hashes_while_copying());
            scratch.hashed.clear();
            running = self.bucket(&plans, &table, sink.is_some(), scratch, &mut failed);
            for (&device, bucket) in &scratch.buckets {
                if bucket.kernel.is_empty() && bucket.copies.is_empty() {
                    continue;
                }
                let queue = match stream {
                    Some(s) if s.device() == device => Queue::Stream(s.raw()),
                    _ => Queue::Own,
                };
                let launched = self.run_bucket(
                    &plans,
                    device,
                    bucket,
                    queue,
                    (&mut scratch.descriptors, &mut scratch.table, &mut scratch.crcs),
                    sink.is_some().then_some(&mut scratch.hashed),
                    &mut failed,
                );
                if let Queue::Stream(_) = queue {
                    let mut carried: Vec<usize> = bucket.copies.iter().map(|j| j.plan).collect();
                    carried.extend(bucket.kernel.iter().map(|(j, _)| j.plan));
                    carried.sort_unstable();
                    carried.dedup();
                    on_stream = Some((launched, carried));
                }
            }
            // The runtime's hashing calls returned with the bytes copied: report them.
            if let Some(sink) = sink {
                for h in &scratch.hashed {
                    sink.copied(&plans.plans()[h.plan], h.tag, h.piece, h.crc);
                }
            }
            lock(&self.scratch).push(taken);
        }
        let pending = match (stream, on_stream) {
            (Some(stream), Some((launched, plans_on_stream))) => {
                // SAFETY: `DeviceStream::new`'s contract: a live stream of its device.
                let event = unsafe {
                    self.runtime.record_event(stream.device(), Queue::Stream(stream.raw()))
                };
                match event {
                    Ok(event) => Some(StreamWork {
                        device: stream.device(),
                        event,
                        launched,
                        plans_on_stream,
                    }),
                    Err(e) => {
                        // Without an event nothing tells when the queued work ends: wait for
                        // the whole stream before letting its memory go, and fail what went
                        // there (whether it landed is unknown).
                        // SAFETY: `DeviceStream::new`'s contract.
                        let waited = unsafe {
                            self.runtime.stream_synchronize(stream.device(), stream.raw())
                        };
                        if let Err(e) = waited {
                            tracing::error!(device = stream.device().get(), error = %e, "could not wait for a caller's stream");
                        }
                        let cause = device_cause(stream.device(), &e);
                        failed.extend(
                            plans_on_stream.iter().map(|&p| Failed::plan(p, cause.clone())),
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        if let Some(device) = caller_device {
            if let Err(e) = self.runtime.set_device(device) {
                tracing::warn!(device = device.get(), error = %e, "could not restore the caller's device");
            }
        }
        match pending {
            None => {
                drop(running);
                let mut failures = failures(self.name(), &plans, failed);
                failures.extend(overlapping);
                TransferHandle::settled(failures, plans)
            }
            Some(work) => TransferHandle::queued_on_stream(Box::new(StreamCompletion {
                engine: self.name().to_owned(),
                kernel_disabled: Arc::clone(&self.kernel_disabled),
                work: Some(work),
                failed,
                overlapping,
                plans,
                running: Some(running),
                pins: Some(pins),
            })),
        }
    }
}

/// What a submit queued on a caller's stream: the event after it and what it carried.
struct StreamWork {
    device: DeviceOrdinal,
    event: u64,
    /// Whether a gather launch went on the stream.
    launched: bool,
    /// The plans with segments on the stream, ascending.
    plans_on_stream: Vec<usize>,
}

/// A submit whose work is queued on a caller's stream, until the event after it completes.
struct StreamCompletion<D: DeviceRuntime> {
    engine: String,
    kernel_disabled: Arc<AtomicBool>,
    /// Taken once the event completed (and was destroyed).
    work: Option<StreamWork>,
    /// Failures found while queueing.
    failed: Vec<Failed>,
    overlapping: Vec<Failure>,
    plans: PlanSet,
    /// Held until the event completed: the memory the work touches stays pinned and allocated.
    running: Option<Running<D>>,
    pins: Option<EndpointPins>,
}

impl<D: DeviceRuntime> StreamCompletion<D> {
    /// Waits for the event, destroys it, records a fault, and lets the memory go.
    fn finish(&mut self) {
        let Some(work) = self.work.take() else { return };
        let runtime = &self.running.as_ref().expect("held until finished").memory.runtime;
        // SAFETY: recorded by `submit` on `work.device`, destroyed only below.
        let waited = unsafe { runtime.event_wait(work.device, work.event) };
        // SAFETY: as above; not used again.
        unsafe { runtime.destroy_event(work.device, work.event) };
        if let Err(e) = waited {
            if work.launched && !self.kernel_disabled.swap(true, Ordering::Relaxed) {
                tracing::error!(device = work.device.get(), error = %e, "a stream with a gather launch reported a fault; the gather kernel is disabled for this engine");
            }
            let cause = device_cause(work.device, &e);
            self.failed
                .extend(work.plans_on_stream.iter().map(|&p| Failed::plan(p, cause.clone())));
        }
        self.running = None;
        self.pins = None;
    }
}

impl<D: DeviceRuntime> Completion for StreamCompletion<D> {
    fn is_done(&self) -> bool {
        let (Some(work), Some(running)) = (&self.work, &self.running) else { return true };
        // SAFETY: recorded by `submit` on `work.device` and not yet destroyed (`work` is still
        // here). A fault counts as done: `wait` reports it without blocking.
        unsafe { running.memory.runtime.event_done(work.device, work.event) }.unwrap_or(true)
    }

    fn wait(&mut self) -> Settled {
        self.finish();
        let plans = std::mem::take(&mut self.plans);
        let mut failures = failures(&self.engine, &plans, std::mem::take(&mut self.failed));
        failures.append(&mut self.overlapping);
        Settled { failures, plans }
    }
}

impl<D: DeviceRuntime> Drop for StreamCompletion<D> {
    fn drop(&mut self) {
        // Never let the memory go while the stream may still touch it.
        self.finish();
    }
}

/// One [`Failure`] per failed plan, naming the tags of exactly its failed segments (all its
/// tags when the whole plan failed), with the first cause seen.
fn failures(engine: &str, plans: &PlanSet, mut failed: Vec<Failed>) -> Vec<Failure> {
    failed.sort_by_key(|f| f.at);
    let mut out: Vec<Failure> = Vec::new();
    let mut current: Option<usize> = None;
    for Failed { at, cause } in failed {
        let pi = at.plan;
        let plan = &plans.plans()[pi];
        let tags = plans.tags_at(at);
        if current != Some(pi) {
            current = Some(pi);
            out.push(Failure {
                engine: engine.into(),
                src: plan.src(),
                dst: plan.dst(),
                tags: Vec::new(),
                cause,
            });
        }
        if let Some(f) = out.last_mut() {
            for &t in tags {
                if !f.tags.contains(&t) {
                    f.tags.push(t);
                }
            }
        }
    }
    out
}

fn device_cause(device: DeviceOrdinal, e: &DeviceError) -> FailureCause {
    FailureCause::Device { device, code: e.code(), message: e.to_string() }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each guarded map is updated by single inserts and removes: a panic cannot tear it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
