//! The simulated device: the default backend, and the one every test and doc example runs on.
//!
//! # Strategy
//!
//! - Device memory is host memory the simulator allocates (256-byte aligned, zeroed) and owns;
//!   its "device address" is its host address, so descriptors are real pointers.
//! - Pinning host memory records the region; its device alias is its own address. Like CUDA's
//!   and HIP's host registration, it refuses a region that overlaps one already pinned
//!   ([`DeviceError::AlreadyPinned`], in its own words: a GPU would report its runtime's code,
//!   CUDA's 712), so a program that pins the same bytes twice fails here as it would on a GPU.
//! - Work runs at submit: a copy or a gather launch executes before the call returns, on
//!   whatever [`Queue`] it names (a caller's stream handle is any value here), and
//!   [`synchronize`](crate::DeviceRuntime::synchronize) only reports an injected fault.
//! - Work from several threads runs side by side, outside the state lock, as kernels from
//!   several streams of a GPU do, unless one would write bytes another running one reads or
//!   writes: then it waits for that one (module `footprint`). Freeing or unpinning memory
//!   waits for the running work that touches it, as freeing GPU memory waits for the device.
//! - Events complete on the host: one recorded after work is complete when recorded, and
//!   waiting for it reports an injected [`DeviceFault::Synchronize`], as a GPU reports a
//!   faulting kernel at the event after it. Handles are checked: an unknown or destroyed
//!   event is an error.
//! - The gather kernel runs on the CPU from the very [`LaunchTable`] the GPU
//!   kernel reads: block by block, each block finding its descriptor by the same search and
//!   copying its slice by the same vector / word / byte path choice. A descriptor bug shows up
//!   here as wrong bytes or as a refused launch.
//! - Unlike a GPU runtime, it checks every address: each descriptor side must lie inside one
//!   allocation of the device or one region pinned for it, and each copy's device side inside
//!   one allocation. A violation fails the call with [`DeviceError::InvalidAddress`].
//! - [`SimDevice::inject`] fails the next launch, synchronization or copy, to test the
//!   engine's fallbacks.

mod footprint;
mod kernel;
mod memory;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use umbp_plan::DeviceOrdinal;

use crate::{DeviceError, DeviceRuntime, GatherDescriptor, LaunchTable, Queue};
use footprint::Footprint;
use memory::Allocation;

/// An operation the simulator can be told to fail once.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DeviceFault {
    /// The next gather launch.
    Launch,
    /// The next synchronization.
    Synchronize,
    /// The next copy.
    Copy,
}

thread_local! {
    /// The calling thread's current device, as a GPU runtime keeps it per thread.
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

/// A simulated device runtime with `devices` devices; see the [module docs](self).
#[derive(Debug)]
pub struct SimDevice {
    devices: u32,
    state: Mutex<State>,
    /// Signalled when running work ends.
    settled: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Device allocations by start address.
    allocations: BTreeMap<u64, Allocation>,
    /// Pinned host regions by start address: (device, length).
    pinned: BTreeMap<u64, (DeviceOrdinal, u64)>,
    /// Faults armed for the next operation of their kind.
    faults: Vec<DeviceFault>,
    /// The "uploaded" launch table, reused across launches as the GPU's descriptor buffer is.
    uploaded: LaunchTable,
    /// The overlap check's scratch: (start, end, is a destination, descriptor index).
    ranges: Vec<(u64, u64, bool, usize)>,
    /// Work running outside the lock: its number and what it reads and writes.
    running: Vec<(u64, Footprint)>,
    /// The number of the next piece of running work.
    next_work: u64,
    /// Live events: handle to device.
    events: BTreeMap<u64, DeviceOrdinal>,
    /// The next event handle (never 0).
    next_event: u64,
}

impl SimDevice {
    /// A simulator with `devices` devices (at least one).
    pub fn new(devices: u32) -> Self {
        Self {
            devices: devices.max(1),
            state: Mutex::new(State::default()),
            settled: Condvar::new(),
        }
    }

    /// Fails the next operation of kind `fault` with [`DeviceError::Injected`].
    pub fn inject(&self, fault: DeviceFault) {
        self.lock().faults.push(fault);
    }

    /// A copy of `len` bytes of device memory at `addr` (which must lie in one allocation).
    pub fn read(&self, addr: u64, len: u64) -> Result<Vec<u8>, DeviceError> {
        let state = self.clear_of(self.lock(), &Footprint::read(addr, len));
        let (device, _) = state
            .allocation_holding(addr, len)
            .ok_or(DeviceError::InvalidAddress { device: DeviceOrdinal::new(0), addr, len })?;
        debug_assert!(device.get() < self.devices);
        // SAFETY: `addr .. + len` lies inside a live allocation (checked above, and the state
        // lock keeps it from being freed meanwhile); no running work writes it (waited for
        // above, and none starts while the lock is held).
        Ok(unsafe { memory::read(addr, len) })
    }

    /// Fills `len` bytes of device memory at `addr` (which must lie in one allocation) with
    /// `byte`.
    pub fn fill(&self, addr: u64, len: u64, byte: u8) -> Result<(), DeviceError> {
        let state = self.clear_of(self.lock(), &Footprint::write(addr, len));
        if state.allocation_holding(addr, len).is_none() {
            return Err(DeviceError::InvalidAddress { device: DeviceOrdinal::new(0), addr, len });
        }
        // SAFETY: as in `read`; the bytes belong to the simulator's allocation.
        unsafe { memory::fill(addr, len, byte) };
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update of the state is a single insert or remove: a panic cannot leave it torn.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until some running work ends (the lock released meanwhile).
    fn wait<'a>(&'a self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.settled.wait(state).unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until no running work conflicts with `footprint`.
    fn clear_of<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        footprint: &Footprint,
    ) -> MutexGuard<'a, State> {
        while state.conflicts(footprint) {
            state = self.wait(state);
        }
        state
    }

    /// Records work with `footprint` as running until the returned guard drops.
    fn start(&self, state: &mut State, footprint: Footprint) -> Running<'_> {
        let id = state.next_work;
        state.next_work += 1;
        state.running.push((id, footprint));
        Running { sim: self, id }
    }

    fn check_device(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        if device.get() < self.devices {
            Ok(())
        } else {
            Err(DeviceError::NoDevice(device))
        }
    }

    /// [`DeviceRuntime::copy`], checked; with `crc`, also extends it with the bytes copied.
    ///
    /// # Safety
    ///
    /// As [`DeviceRuntime::copy`].
    unsafe fn copy_checked(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        crc: Option<&mut u32>,
    ) -> Result<(), DeviceError> {
        self.check_device(device)?;
        let mut state = self.lock();
        state.take_fault(DeviceFault::Copy)?;
        let footprint = Footprint::copy(src, dst, len);
        // Checked again after every wait: memory may be freed meanwhile.
        loop {
            // Each side lies wholly in one allocation, or (host memory) overlaps none; and at
            // least one side is memory of this simulator.
            let side_ok = |addr: u64| {
                state.allocation_holding(addr, len).is_some()
                    || !state.touches_allocation(addr, len)
            };
            let device_side = state.allocation_holding(src, len).is_some()
                || state.allocation_holding(dst, len).is_some();
            if !side_ok(src) || !side_ok(dst) || !device_side {
                let addr = if side_ok(src) { dst } else { src };
                return Err(DeviceError::InvalidAddress { device, addr, len });
            }
            if !state.conflicts(&footprint) {
                break;
            }
            state = self.wait(state);
        }
        let running = self.start(&mut state, footprint);
        drop(state);
        // SAFETY: the device side lies in a live allocation (checked), which `free` leaves
        // alone while this work runs (its footprint covers the bytes); the host side is valid
        // by this function's contract; no other running work writes what this copy touches
        // or touches what it writes (footprints); `ptr::copy` tolerates overlap.
        unsafe { memory::copy(dst, src, len, crc) };
        drop(running);
        Ok(())
    }

    /// [`DeviceRuntime::gather`], checked; with `crcs`, also sets each descriptor's CRC32C.
    ///
    /// # Safety
    ///
    /// As [`DeviceRuntime::gather`].
    unsafe fn gather_checked(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        crcs: Option<&mut [u32]>,
    ) -> Result<(), DeviceError> {
        self.check_device(device)?;
        let mut state = self.lock();
        state.take_fault(DeviceFault::Launch)?;
        // Checked again after every wait: memory may be freed or unpinned meanwhile.
        let footprint = loop {
            // Descriptors of one launch mostly fall in the same few regions: try the region the
            // previous descriptor's side fell in before searching.
            let mut last = [(0u64, 0u64); 2];
            for d in &table.descriptors {
                for (side, addr) in [d.src, d.dst].into_iter().enumerate() {
                    let (start, end) = last[side];
                    let inside = addr >= start && addr.checked_add(d.len).is_some_and(|e| e <= end);
                    if !inside {
                        last[side] = state
                            .visible_region(device, addr, d.len)
                            .ok_or(DeviceError::InvalidAddress { device, addr, len: d.len })?;
                    }
                }
            }
            // The kernel's blocks run in no order: a destination that overlaps a source or
            // another destination has no defined result (a race on the GPU). The engine never
            // launches one; a caller of this trait that does gets an error, not undefined
            // behaviour.
            if let Some(d) = first_overlap(&table.descriptors, &mut state.ranges) {
                return Err(DeviceError::InvalidAddress { device, addr: d.dst, len: d.len });
            }
            let footprint = Footprint::of_sorted(&state.ranges);
            if !state.conflicts(&footprint) {
                break footprint;
            }
            state = self.wait(state);
        };
        // The upload the GPU backend does into its descriptor buffer (reused across launches;
        // one running beside this one uploads into a buffer of its own).
        let mut uploaded = std::mem::take(&mut state.uploaded);
        uploaded.descriptors.clone_from(&table.descriptors);
        uploaded.block_starts.clone_from(&table.block_starts);
        let running = self.start(&mut state, footprint);
        drop(state);
        // SAFETY: every descriptor side lies in memory visible to this device (checked above):
        // allocations, which `free` leaves alone while this work runs (its footprint covers
        // them), or pinned host regions, valid by `register_host`'s contract and not unpinned
        // while this runs; no destination overlaps a source or another destination (checked
        // above), and no other running work writes what this launch touches or touches what it
        // writes (footprints).
        unsafe { kernel::run(&uploaded, crcs) };
        self.lock().uploaded = uploaded;
        drop(running);
        Ok(())
    }
}

/// Work running outside the lock; ends it (and wakes whoever waits for it) when dropped, also
/// when unwinding.
struct Running<'a> {
    sim: &'a SimDevice,
    id: u64,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.sim.lock().running.retain(|(id, _)| *id != self.id);
        self.sim.settled.notify_all();
    }
}

impl State {
    /// Whether running work conflicts with `footprint`.
    fn conflicts(&self, footprint: &Footprint) -> bool {
        self.running.iter().any(|(_, f)| f.conflicts(footprint))
    }

    /// The allocation wholly holding `addr .. + len`: its device and start.
    fn allocation_holding(&self, addr: u64, len: u64) -> Option<(DeviceOrdinal, u64)> {
        let (&start, a) = self.allocations.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        (end <= start + a.len).then_some((a.device, start))
    }

    /// Whether `addr .. + len` overlaps any allocation.
    fn touches_allocation(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        self.allocations.range(..end).next_back().is_some_and(|(&s, a)| s + a.len > addr)
    }

    /// The region (`start .. end`) inside which `device` may read or write `addr .. + len` in a
    /// kernel: one of its allocations or one region pinned for it.
    fn visible_region(&self, device: DeviceOrdinal, addr: u64, len: u64) -> Option<(u64, u64)> {
        if let Some((d, start)) = self.allocation_holding(addr, len) {
            let end = start + self.allocations[&start].len;
            return (d == device).then_some((start, end));
        }
        let (&start, &(d, region_len)) = self.pinned.range(..=addr).next_back()?;
        let fits = addr.checked_add(len).is_some_and(|end| end <= start + region_len);
        (d == device && fits).then_some((start, start + region_len))
    }

    fn check_event(&self, device: DeviceOrdinal, event: u64) -> Result<(), DeviceError> {
        match self.events.get(&event) {
            Some(&d) if d == device => Ok(()),
            _ => Err(DeviceError::InvalidAddress { device, addr: event, len: 0 }),
        }
    }

    fn take_fault(&mut self, fault: DeviceFault) -> Result<(), DeviceError> {
        match self.faults.iter().position(|&f| f == fault) {
            Some(i) => Err(DeviceError::Injected(self.faults.remove(i))),
            None => Ok(()),
        }
    }
}

impl Default for SimDevice {
    /// One device.
    fn default() -> Self {
        Self::new(1)
    }
}

impl DeviceRuntime for SimDevice {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> Result<u32, DeviceError> {
        Ok(self.devices)
    }

    fn current_device(&self) -> Result<DeviceOrdinal, DeviceError> {
        Ok(DeviceOrdinal::new(CURRENT.with(Cell::get)))
    }

    fn set_device(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        self.check_device(device)?;
        CURRENT.with(|c| c.set(device.get()));
        Ok(())
    }

    fn alloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
        self.check_device(device)?;
        let allocation = Allocation::new(device, len)?;
        let addr = allocation.addr();
        self.lock().allocations.insert(addr, allocation);
        Ok(addr)
    }

    unsafe fn free(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        let mut state = self.lock();
        loop {
            let whole = match state.allocations.get(&addr) {
                Some(a) if a.device == device => Footprint::write(addr, a.len),
                _ => return Err(DeviceError::InvalidAddress { device, addr, len: 0 }),
            };
            if !state.conflicts(&whole) {
                state.allocations.remove(&addr);
                return Ok(());
            }
            // Work running on it ends first; the allocation may be gone after the wait.
            state = self.wait(state);
        }
    }

    unsafe fn register_host(
        &self,
        device: DeviceOrdinal,
        addr: u64,
        len: u64,
    ) -> Result<u64, DeviceError> {
        self.check_device(device)?;
        let mut state = self.lock();
        if len == 0 || addr.checked_add(len).is_none() || state.touches_allocation(addr, len) {
            return Err(DeviceError::InvalidAddress { device, addr, len });
        }
        // A GPU runtime refuses to register host memory twice, in whole or in part.
        let end = addr + len;
        if state.pinned.range(..end).next_back().is_some_and(|(&s, &(_, l))| s + l > addr) {
            return Err(DeviceError::AlreadyPinned { device, addr, len });
        }
        state.pinned.insert(addr, (device, len));
        Ok(addr)
    }

    unsafe fn unregister_host(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        let mut state = self.lock();
        loop {
            let whole = match state.pinned.get(&addr) {
                Some(&(_, len)) => Footprint::write(addr, len),
                None => return Err(DeviceError::InvalidAddress { device, addr, len: 0 }),
            };
            if !state.conflicts(&whole) {
                state.pinned.remove(&addr);
                return Ok(());
            }
            state = self.wait(state);
        }
    }

    unsafe fn copy(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        _queue: Queue,
    ) -> Result<(), DeviceError> {
        // SAFETY: this function's contract is `copy_checked`'s.
        unsafe { self.copy_checked(device, dst, src, len, None) }
    }

    unsafe fn gather(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        _queue: Queue,
    ) -> Result<(), DeviceError> {
        // SAFETY: this function's contract is `gather_checked`'s.
        unsafe { self.gather_checked(device, table, None) }
    }

    fn hashes_while_copying(&self) -> bool {
        true
    }

    unsafe fn copy_hashed(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        _queue: Queue,
    ) -> Result<u32, DeviceError> {
        let mut crc = 0;
        // SAFETY: this function's contract is `copy_checked`'s.
        unsafe { self.copy_checked(device, dst, src, len, Some(&mut crc))? };
        Ok(crc)
    }

    unsafe fn gather_hashed(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        _queue: Queue,
        crcs: &mut [u32],
    ) -> Result<(), DeviceError> {
        if crcs.len() != table.descriptors.len() {
            let message =
                format!("{} CRCs for {} descriptors", crcs.len(), table.descriptors.len());
            return Err(DeviceError::Runtime { device, code: -1, message });
        }
        // SAFETY: this function's contract is `gather_checked`'s.
        unsafe { self.gather_checked(device, table, Some(crcs)) }
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        self.check_device(device)?;
        self.lock().take_fault(DeviceFault::Synchronize)
    }

    unsafe fn stream_synchronize(&self, device: DeviceOrdinal, _: u64) -> Result<(), DeviceError> {
        self.synchronize(device)
    }

    unsafe fn record_event(
        &self,
        device: DeviceOrdinal,
        _queue: Queue,
    ) -> Result<u64, DeviceError> {
        self.check_device(device)?;
        let mut state = self.lock();
        state.next_event += 1;
        let event = state.next_event;
        state.events.insert(event, device);
        Ok(event)
    }

    unsafe fn event_done(&self, device: DeviceOrdinal, event: u64) -> Result<bool, DeviceError> {
        self.lock().check_event(device, event)?;
        Ok(true)
    }

    unsafe fn event_wait(&self, device: DeviceOrdinal, event: u64) -> Result<(), DeviceError> {
        let mut state = self.lock();
        state.check_event(device, event)?;
        state.take_fault(DeviceFault::Synchronize)
    }

    unsafe fn destroy_event(&self, device: DeviceOrdinal, event: u64) {
        let mut state = self.lock();
        if state.check_event(device, event).is_ok() {
            state.events.remove(&event);
        }
    }
}

/// A descriptor whose destination shares a byte with another descriptor's source or
/// destination (or its own source), if any: one sort and one sweep over the launch's ranges.
fn first_overlap(
    descriptors: &[GatherDescriptor],
    ranges: &mut Vec<(u64, u64, bool, usize)>,
) -> Option<GatherDescriptor> {
    ranges.clear();
    for (i, d) in descriptors.iter().enumerate().filter(|(_, d)| d.len > 0) {
        ranges.push((d.src, d.src.saturating_add(d.len), false, i));
        ranges.push((d.dst, d.dst.saturating_add(d.len), true, i));
    }
    ranges.sort_unstable_by_key(|r| r.0);
    let (mut read_end, mut written_end) = (0u64, 0u64);
    for &(start, end, written, i) in ranges.iter() {
        // Sorted by start: an earlier range meets this one exactly when it ends after it starts.
        if start < written_end || (written && start < read_end) {
            return Some(descriptors[i]);
        }
        if written {
            written_end = written_end.max(end);
        } else {
            read_end = read_end.max(end);
        }
    }
    None
}
