//! Endpoints: the registered regions where bytes live, and the registry that names them.
//!
//! An endpoint is described once and referenced afterwards by a small [`EndpointId`], so a
//! fragment never carries an endpoint description. Descriptions are plain data: umbp-plan never
//! dereferences an address. The engines do, which is why registering a memory endpoint is
//! `unsafe` (see [`EndpointRegistry::register`]).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use crate::Error;

/// Names a registered endpoint: a slot of its [`EndpointRegistry`] and the generation of that
/// slot. A slot is reused once its endpoint is deregistered, with the next generation, so the
/// registry's state stays as small as what is registered now, and a stale id can only be
/// unknown, never name the memory registered after it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct EndpointId(u64);

impl EndpointId {
    /// Builds an id from its raw value, for example one read back from a log or a test table.
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw value of this id: the generation in the high 32 bits, the slot in the low 32.
    pub const fn raw(self) -> u64 {
        self.0
    }

    /// The id's slot, as an index into a dense per-slot table. Two registered endpoints never
    /// share a slot, but a stale id shares one with the endpoint that reused it: a table
    /// indexed by slot must compare whole ids where identity matters.
    pub const fn index(self) -> usize {
        self.0 as u32 as usize
    }

    /// How many endpoints held this id's slot before it.
    pub const fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }

    const fn new(slot: u32, generation: u32) -> Self {
        Self(((generation as u64) << 32) | slot as u64)
    }
}

/// The caller's object index. Every fragment carries the tag of the object it belongs to; tags
/// survive merging so that a failed segment maps back to the objects it carried.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct Tag(u32);

impl Tag {
    /// A tag for object number `index` of the caller's batch.
    pub const fn new(index: u32) -> Self {
        Self(index)
    }

    /// The object index this tag stands for.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// The tag as an index into a per-object table.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// A device ordinal, as the device runtime numbers its GPUs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct DeviceOrdinal(u32);

impl DeviceOrdinal {
    /// The device with ordinal `ordinal`.
    pub const fn new(ordinal: u32) -> Self {
        Self(ordinal)
    }

    /// The ordinal.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// A range of an open file that an endpoint covers.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct FileRange {
    /// The raw file descriptor.
    pub fd: i32,
    /// Where the endpoint starts inside the file; endpoint offset 0 is this file offset.
    pub file_offset: u64,
    /// Whether the descriptor was opened with `O_DIRECT`.
    pub direct: bool,
}

/// A region of memory that another node exported to this process: which peer, and which of
/// its exported regions. A remote engine (umbp-remote) hands these out when it connects to a peer;
/// the numbers mean nothing to any other engine.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteRegion {
    /// The peer, as numbered by the engine that connected to it (unique in the process).
    pub peer: u32,
    /// The region, as numbered by the peer in its export list.
    pub region: u32,
}

/// Where an endpoint's bytes live.
///
/// Engines match on it with a wildcard arm: a kind an engine does not know is one it does not
/// carry (new kinds arrive as new tiers do, the remote one last).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EndpointKind {
    /// Host memory of this process.
    Host,
    /// Memory of one device.
    Device(DeviceOrdinal),
    /// A range of an open file.
    File(FileRange),
    /// Part of a region another node exported; the endpoint's [address](Endpoint::addr) is the
    /// offset of its first byte inside that region.
    Remote(RemoteRegion),
}

/// The description of one registered region: its kind, its base address (memory kinds) and its
/// length. Offsets in fragments are relative to the start of the region.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    kind: EndpointKind,
    addr: u64,
    len: u64,
}

impl Endpoint {
    /// Host memory starting at address `addr`, `len` bytes long.
    pub const fn host(addr: u64, len: u64) -> Self {
        Self { kind: EndpointKind::Host, addr, len }
    }

    /// Device memory of `device` starting at device address `addr`, `len` bytes long.
    pub const fn device(device: DeviceOrdinal, addr: u64, len: u64) -> Self {
        Self { kind: EndpointKind::Device(device), addr, len }
    }

    /// `len` bytes of the file open as `fd`, starting at `file_offset`.
    pub const fn file(fd: i32, file_offset: u64, len: u64, direct: bool) -> Self {
        Self { kind: EndpointKind::File(FileRange { fd, file_offset, direct }), addr: 0, len }
    }

    /// `len` bytes of the exported remote `region`, starting `offset` bytes into it. Nothing in
    /// this process is dereferenced through it: the engine that owns the peer checks every
    /// access against the region the peer exported (see
    /// [`Register::register_remote`](crate::Register::register_remote)).
    pub const fn remote(region: RemoteRegion, offset: u64, len: u64) -> Self {
        Self { kind: EndpointKind::Remote(region), addr: offset, len }
    }

    /// Where the bytes live.
    pub const fn kind(&self) -> EndpointKind {
        self.kind
    }

    /// The base address for memory endpoints; 0 for files; the offset inside the exported
    /// region for remote endpoints.
    pub const fn addr(&self) -> u64 {
        self.addr
    }

    /// The length of the region in bytes.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this is host memory.
    pub const fn is_host(&self) -> bool {
        matches!(self.kind, EndpointKind::Host)
    }

    /// The device ordinal, for device memory.
    pub const fn device_ordinal(&self) -> Option<DeviceOrdinal> {
        match self.kind {
            EndpointKind::Device(d) => Some(d),
            _ => None,
        }
    }

    /// The file range, for file endpoints.
    pub const fn file_range(&self) -> Option<FileRange> {
        match self.kind {
            EndpointKind::File(f) => Some(f),
            _ => None,
        }
    }

    /// The exported region, for remote endpoints.
    pub const fn remote_region(&self) -> Option<RemoteRegion> {
        match self.kind {
            EndpointKind::Remote(r) => Some(r),
            _ => None,
        }
    }

    /// Whether `offset .. offset + len` lies inside the region, overflow-safe.
    pub const fn contains(&self, offset: u64, len: u64) -> bool {
        match offset.checked_add(len) {
            Some(end) => end <= self.len,
            None => false,
        }
    }
}

/// An immutable snapshot of the registry: id to description. Plan builders hold one so that
/// looking an endpoint up on the push path is an array index, not a lock.
#[derive(Clone, Debug, Default)]
pub struct EndpointTable {
    slots: Vec<Slot>,
}

/// One slot of a table: the generation it is at, and its endpoint while registered.
#[derive(Copy, Clone, Debug, Default)]
struct Slot {
    generation: u32,
    endpoint: Option<Endpoint>,
}

impl EndpointTable {
    /// The description of `id`, if it is registered in this snapshot.
    #[inline]
    pub fn get(&self, id: EndpointId) -> Option<&Endpoint> {
        self.slots
            .get(id.index())
            .filter(|slot| slot.generation == id.generation())
            .and_then(|slot| slot.endpoint.as_ref())
    }

    /// Every registered endpoint of this snapshot with its id.
    pub fn iter(&self) -> impl Iterator<Item = (EndpointId, &Endpoint)> {
        self.slots.iter().enumerate().filter_map(|(i, slot)| {
            slot.endpoint.as_ref().map(|e| (EndpointId::new(i as u32, slot.generation), e))
        })
    }

    /// How many slots the table holds, registered or free: at most the largest number of
    /// endpoints registered at once, however many came and went.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }
}

/// Names endpoints for every engine that shares it.
///
/// Registration is copy-on-write: each change publishes a new [`EndpointTable`], and
/// [`snapshot`](Self::snapshot) hands out the current one without copying. A registration
/// copies one slot per endpoint registered now (deregistered slots are reused, see
/// [`EndpointId`]), so its cost and the registry's memory follow what is registered, not how
/// many registrations came before; lookups are constant.
///
/// # Lifetimes
///
/// A submitted batch [pins](Self::pin) the endpoints it uses until it settles and resolves
/// them in the table the pin hands out ([`EndpointPins::table`]); [`deregister`](Self::deregister)
/// waits until nothing pins the endpoint. So once deregister returns, no engine still reads or
/// writes the region, and its memory may be freed.
///
/// While a deregistration waits, batches that already pin the endpoint may pin it again (a
/// composite's batch, then the engine running its part); a batch that starts after the
/// endpoint's last pin went finds it gone
/// ([`FailureCause::EndpointGone`](crate::FailureCause::EndpointGone)), so a stream of batches
/// one after another cannot hold a deregistration off.
#[derive(Debug, Default)]
pub struct EndpointRegistry {
    current: Mutex<Current>,
    /// What the caller calls each named endpoint: a label given at registration
    /// ([`Registration::set_label`](crate::Registration::set_label)) or a file's path. Read
    /// only to word errors, never on a transfer's path.
    names: Mutex<HashMap<EndpointId, Arc<str>>>,
    pins: Mutex<Pins>,
    /// Signalled when an endpoint's pin count drops to zero.
    unpinned: Condvar,
}

/// The published table, and the slots free for the next registrations.
#[derive(Debug, Default)]
struct Current {
    table: Arc<EndpointTable>,
    /// Deregistered slots, reused last-freed first. A slot whose generation cannot grow is
    /// retired instead, so an id is never handed out twice.
    free: Vec<u32>,
}

/// Pin counts, and the endpoints whose deregistration is waiting for theirs to drain.
#[derive(Debug, Default)]
struct Pins {
    /// Pin count per slot: an array index per pin, no hashing, on every submit's path. A slot
    /// is freed only once its count is zero, so the count of a slot is its endpoint's.
    counts: Vec<(EndpointId, u32)>,
    dying: Vec<EndpointId>,
}

impl Pins {
    fn count(&self, id: EndpointId) -> u32 {
        held(&self.counts, id)
    }
}

/// The pins on `id` in `counts` (a count left by an earlier generation of its slot is zero).
fn held(counts: &[(EndpointId, u32)], id: EndpointId) -> u32 {
    match counts.get(id.index()) {
        Some(&(holder, n)) if holder == id => n,
        _ => 0,
    }
}

/// Endpoints pinned by one batch, and the table to resolve them in; unpinned when dropped.
/// See [`EndpointRegistry::pin`].
#[derive(Debug)]
#[must_use = "the endpoints are unpinned when this is dropped"]
pub struct EndpointPins {
    registry: Arc<EndpointRegistry>,
    ids: Vec<EndpointId>,
    table: Arc<EndpointTable>,
}

impl EndpointPins {
    /// The endpoints as the batch must see them: every pinned endpoint that was registered
    /// when pinned, and none that was on its way out.
    pub fn table(&self) -> &Arc<EndpointTable> {
        &self.table
    }
}

impl Drop for EndpointPins {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut pins = self.registry.lock_pins();
        let mut released = false;
        for id in &self.ids {
            if let Some((_, n)) = pins.counts.get_mut(id.index()) {
                *n = n.saturating_sub(1);
                released |= *n == 0;
            }
        }
        drop(pins);
        if released {
            self.registry.unpinned.notify_all();
        }
    }
}

impl EndpointRegistry {
    /// An empty registry, shared by the engines that will use its ids.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Registers an endpoint of any kind and returns its id: the layer beneath
    /// [`Register`](crate::Register), which callers use instead (it returns a guard that
    /// deregisters, and prepares the engines). Nothing deregisters an id registered here but
    /// [`deregister`](Self::deregister).
    ///
    /// # Safety
    ///
    /// Engines read and write memory endpoints through their addresses after checking only that
    /// every access lies inside `0 .. len`. For a [`EndpointKind::Host`] or
    /// [`EndpointKind::Device`] endpoint:
    /// - `addr .. addr + len` must be memory of that kind, valid for reads and writes, and
    /// - it must stay valid until the endpoint is [deregistered](Self::deregister) and every
    ///   transfer handle that used it has been waited on (or dropped, which waits);
    /// - while a transfer runs, nothing else may access the bytes it writes.
    ///
    /// File endpoints carry no memory obligation: a wrong descriptor fails transfers or reaches
    /// the wrong file, never memory.
    #[allow(unsafe_code)] // Declares the obligation; umbp-plan itself never dereferences it.
    pub unsafe fn register(&self, endpoint: Endpoint) -> EndpointId {
        self.insert(endpoint)
    }

    /// Adds `endpoint` to the table; the caller has checked what `register` asks.
    pub(crate) fn insert(&self, endpoint: Endpoint) -> EndpointId {
        self.publish(|slots, free| match free.pop() {
            Some(slot) => {
                let entry = &mut slots[slot as usize];
                entry.generation += 1;
                entry.endpoint = Some(endpoint);
                EndpointId::new(slot, entry.generation)
            }
            None => {
                // Every slot holds a registered endpoint (or a retired id): more than u32::MAX
                // of them would need hundreds of GiB for the table alone.
                let slot = u32::try_from(slots.len()).expect("fewer than 2^32 endpoints at once");
                slots.push(Slot { generation: 0, endpoint: Some(endpoint) });
                EndpointId::new(slot, 0)
            }
        })
    }

    /// What the caller calls endpoint `id`: the label given at registration
    /// ([`Registration::set_label`](crate::Registration::set_label)), else the path of a file
    /// registered by path; `None` for an unnamed or unknown endpoint.
    pub fn name(&self, id: EndpointId) -> Option<Arc<str>> {
        self.lock_names().get(&id).cloned()
    }

    /// Names endpoint `id` `name` (replacing any name it had); an unknown id is ignored.
    pub(crate) fn set_name(&self, id: EndpointId, name: Arc<str>) {
        if self.get(id).is_some() {
            self.lock_names().insert(id, name);
        }
    }

    fn lock_names(&self) -> MutexGuard<'_, HashMap<EndpointId, Arc<str>>> {
        // A map of names: a poisoned lock still guards a consistent map.
        self.names.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes an endpoint and returns its description, once no submitted batch pins it (it
    /// waits for those batches to settle). Builders that already hold a snapshot may still plan
    /// against it; engines look endpoints up again at submit and fail plans whose endpoint is
    /// gone.
    ///
    /// Waiting for a batch from a thread that batch needs (a callback it runs, say) deadlocks;
    /// deregister from elsewhere.
    pub fn deregister(&self, id: EndpointId) -> Result<Endpoint, Error> {
        let mut pins = self.lock_pins();
        if self.get(id).is_none() {
            return Err(Error::UnknownEndpoint { id });
        }
        pins.dying.push(id);
        while pins.count(id) > 0 {
            pins = self.unpinned.wait(pins).unwrap_or_else(PoisonError::into_inner);
        }
        if let Some(at) = pins.dying.iter().position(|&d| d == id) {
            pins.dying.swap_remove(at);
        }
        self.lock_names().remove(&id);
        // Published while the pins are locked: a batch pinning now finds it gone.
        self.publish(|slots, free| {
            let slot = slots
                .get_mut(id.index())
                .filter(|slot| slot.generation == id.generation())
                .ok_or(Error::UnknownEndpoint { id })?;
            let endpoint = slot.endpoint.take().ok_or(Error::UnknownEndpoint { id })?;
            if slot.generation < u32::MAX {
                free.push(id.index() as u32);
            }
            Ok(endpoint)
        })
    }

    /// Pins `ids` until the returned guard is dropped, and returns the table to resolve them
    /// in: [`deregister`](Self::deregister) of any of them waits until the guard goes. An
    /// engine pins the endpoints of a plan set when it is submitted
    /// ([`PlanSet::endpoints`](crate::PlanSet::endpoints)), resolves its plans in
    /// [`EndpointPins::table`], and drops the guard when the batch settles.
    ///
    /// An endpoint whose deregistration is waiting is pinned again only while something still
    /// pins it (the same batch, one layer down); otherwise it is left out of the table, as if
    /// already gone.
    pub fn pin(self: &Arc<Self>, ids: impl IntoIterator<Item = EndpointId>) -> EndpointPins {
        let mut ids: Vec<EndpointId> = ids.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        let mut pins = self.lock_pins();
        // Taken under the pin lock, which deregistration publishes under: consistent with the
        // counts below.
        let mut table = self.snapshot();
        let mut refused = Vec::new();
        let Pins { counts, dying } = &mut *pins;
        ids.retain(|&id| {
            // An id the registry does not hold needs no pin (its plans fail as gone), and
            // counting it would size the counts by a caller's number.
            if table.get(id).is_none() {
                return false;
            }
            if dying.contains(&id) && held(counts, id) == 0 {
                refused.push(id);
                return false;
            }
            if counts.len() <= id.index() {
                counts.resize(id.index() + 1, (id, 0));
            }
            // A slot is reused only once its count fell to zero: a count of another
            // generation is that zero.
            let (holder, n) = &mut counts[id.index()];
            if *holder != id {
                (*holder, *n) = (id, 0);
            }
            *n += 1;
            true
        });
        drop(pins);
        if !refused.is_empty() {
            let mut without = EndpointTable::clone(&table);
            for id in refused {
                if let Some(slot) = without.slots.get_mut(id.index()) {
                    slot.endpoint = None;
                }
            }
            table = Arc::new(without);
        }
        EndpointPins { registry: Arc::clone(self), ids, table }
    }

    /// Whether a submitted batch pins `id` now.
    pub fn is_pinned(&self, id: EndpointId) -> bool {
        self.lock_pins().count(id) > 0
    }

    fn lock_pins(&self) -> MutexGuard<'_, Pins> {
        // Counts change by one under the lock: a poisoned map is still consistent.
        self.pins.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The description of `id` as currently registered.
    pub fn get(&self, id: EndpointId) -> Option<Endpoint> {
        self.lock().table.get(id).copied()
    }

    /// The current table; later registrations do not change it.
    pub fn snapshot(&self) -> Arc<EndpointTable> {
        Arc::clone(&self.lock().table)
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        // A panic while holding the lock cannot leave the table half-written: publication is a
        // single `Arc` store after the free list's change, which cannot panic, so a poisoned
        // lock still guards a consistent table.
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies `change` to a copy of the slots and the free list, and publishes the copy.
    fn publish<T>(&self, change: impl FnOnce(&mut Vec<Slot>, &mut Vec<u32>) -> T) -> T {
        let mut current = self.lock();
        let mut slots = current.table.slots.clone();
        let mut free = current.free.clone();
        let out = change(&mut slots, &mut free);
        current.free = free;
        current.table = Arc::new(EndpointTable { slots });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl EndpointRegistry {
        fn insert_file(&self, fd: i32, file_offset: u64, len: u64, direct: bool) -> EndpointId {
            self.insert(Endpoint::file(fd, file_offset, len, direct))
        }
    }

    #[test]
    fn slots_are_reused_with_a_new_generation_and_snapshots_do_not_change() {
        let registry = EndpointRegistry::new();
        let a = registry.insert_file(3, 0, 100, true);
        let before = registry.snapshot();
        let b = registry.insert_file(4, 4096, 200, false);
        assert_eq!((a.raw(), b.raw()), (0, 1), "the first ids are the slots in order");
        assert!(before.get(b).is_none(), "a snapshot does not see later registrations");
        assert_eq!(registry.deregister(a).map(|e| e.len()), Ok(100));
        assert_eq!(registry.deregister(a), Err(Error::UnknownEndpoint { id: a }));
        assert!(registry.get(a).is_none());
        assert!(before.get(a).is_some(), "an old snapshot still describes it");
        let c = registry.insert_file(5, 0, 1, false);
        assert_eq!((c.index(), c.generation()), (a.index(), 1), "a's slot, one generation on");
        assert_ne!(c, a);
        assert!(registry.get(a).is_none(), "the stale id does not name the new endpoint");
        assert_eq!(registry.deregister(a), Err(Error::UnknownEndpoint { id: a }));
        assert!(!registry.is_pinned(a));
        assert_eq!(registry.get(c).and_then(|e| e.file_range()).map(|f| f.fd), Some(5));
        assert!(before.get(c).is_none(), "nor does an old snapshot name the new one");
        let file = registry.get(b).and_then(|e| e.file_range());
        assert_eq!(file, Some(FileRange { fd: 4, file_offset: 4096, direct: false }));
        let ids: Vec<_> = registry.snapshot().iter().map(|(id, _)| id).collect();
        assert_eq!(ids, [c, b]);
    }

    #[test]
    fn a_hundred_thousand_registrations_leave_the_table_as_small_as_what_is_registered() {
        let registry = EndpointRegistry::new();
        let live: Vec<_> = (0..3).map(|i| registry.insert_file(i, 0, 10, false)).collect();
        let mut seen = std::collections::HashSet::new();
        // Miri interprets each cycle: a few hundred show the reuse there too.
        let cycles = if cfg!(miri) { 300 } else { 100_000u32 };
        for i in 0..cycles {
            let id = registry.insert_file(10, u64::from(i), 1, false);
            assert!(seen.insert(id), "id {id:?} handed out twice");
            let pins = registry.pin([id, live[0]]);
            drop(pins);
            assert!(registry.deregister(id).is_ok());
        }
        let table = registry.snapshot();
        assert_eq!(table.slot_count(), 4);
        assert_eq!(table.iter().map(|(id, _)| id).collect::<Vec<_>>(), live);
        assert_eq!(registry.lock_pins().counts.len(), 4);
    }

    #[test]
    fn a_pin_on_a_stale_id_pins_nothing_and_does_not_touch_the_new_endpoint() {
        let registry = EndpointRegistry::new();
        let old = registry.insert_file(3, 0, 10, false);
        assert!(registry.deregister(old).is_ok());
        let new = registry.insert_file(4, 0, 10, false);
        assert_eq!(new.index(), old.index());
        let stale = registry.pin([old]);
        assert!(stale.table().get(old).is_none());
        assert!(!registry.is_pinned(new));
        let live = registry.pin([new]);
        assert!(registry.is_pinned(new) && !registry.is_pinned(old));
        drop(stale);
        assert!(registry.is_pinned(new), "dropping the stale pin left the new one's count");
        drop(live);
        assert!(registry.deregister(new).is_ok());
    }

    #[test]
    fn deregister_waits_for_the_batches_that_pin_an_endpoint() {
        let registry = EndpointRegistry::new();
        let (a, b) = (registry.insert_file(3, 0, 10, false), registry.insert_file(4, 0, 10, false));
        let pins = registry.pin([a, a, b]);
        assert!(registry.is_pinned(a) && registry.is_pinned(b));
        assert!(pins.table().get(a).is_some());
        let second = registry.pin([a]);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let out = registry.deregister(a);
                done.store(true, std::sync::atomic::Ordering::SeqCst);
                out
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(
                !done.load(std::sync::atomic::Ordering::SeqCst),
                "deregister returned while pinned"
            );
            drop(pins);
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(
                !done.load(std::sync::atomic::Ordering::SeqCst),
                "the second batch still pins it"
            );
            assert!(registry.get(a).is_some());
            drop(second);
            assert_eq!(waiter.join().unwrap().map(|e| e.len()), Ok(10));
        });
        // A batch that pins it once the last pin went and before it was removed would see it
        // gone; after removal it is simply unknown, and so is an id never handed out: neither
        // is pinned (nor sizes anything).
        let late = registry.pin([a, EndpointId::from_raw(u64::MAX)]);
        assert!(late.table().get(a).is_none());
        assert!(!registry.is_pinned(a) && !registry.is_pinned(EndpointId::from_raw(u64::MAX)));
        drop(late);
        assert!(!registry.is_pinned(a) && !registry.is_pinned(b));
        assert!(registry.get(a).is_none());
        assert!(registry.deregister(b).is_ok(), "nothing pins b any more");
    }

    #[test]
    fn contains_is_overflow_safe() {
        let e = Endpoint::host(0, 100);
        assert!(e.contains(0, 100));
        assert!(e.contains(100, 0));
        assert!(!e.contains(1, 100));
        assert!(!e.contains(u64::MAX, 2));
    }
}
