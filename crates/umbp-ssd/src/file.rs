//! File endpoints: what the engine knows about each one.

use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, PoisonError};

use umbp_plan::{EndpointId, FailureCause, FileRange};

use crate::sectors::FileKey;
use crate::sys;

/// What the engine knows about a file endpoint.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FileInfo {
    /// The descriptor.
    pub fd: RawFd,
    /// Whether the descriptor really has `O_DIRECT` (after any fallback).
    pub direct: bool,
    /// The alignment `O_DIRECT` needs for file offsets, lengths and memory addresses: the
    /// logical block size (4096 when the kernel does not say).
    pub block_size: u64,
    /// Whether the descriptor is open for writing.
    pub writable: bool,
}

/// A file endpoint as the executors use it. The descriptor belongs to the endpoint's
/// [`Registration`](umbp_plan::Registration), which closes it only after deregistering, and
/// deregistering waits for the batches that pin the endpoint: no batch holds an entry whose
/// descriptor is closed.
#[derive(Debug)]
pub(crate) struct FileEntry {
    pub(crate) info: FileInfo,
    /// The file's identity, whichever descriptor names it: what orders the read-modify-writes
    /// of its blocks across descriptors (see `sectors`).
    pub(crate) key: FileKey,
}

impl FileEntry {
    /// The alignment transfers on this file need: the block size with `O_DIRECT`, else 1.
    pub(crate) fn align(&self) -> u64 {
        if self.info.direct {
            self.info.block_size
        } else {
            1
        }
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.info.fd
    }

    /// Inspects a descriptor: its flags, block size and identity.
    fn inspect(fd: RawFd) -> io::Result<Self> {
        let flags = sys::status_flags(fd)?;
        let direct = flags & libc::O_DIRECT != 0;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let block_size = sys::logical_block_size(fd);
        let (dev, ino) = sys::file_identity(fd)?;
        let info = FileInfo { fd, direct, block_size, writable };
        Ok(Self { info, key: FileKey { dev, ino } })
    }
}

/// The engine's table of file endpoints.
#[derive(Debug, Default)]
pub(crate) struct FileTable {
    slots: Mutex<HashMap<EndpointId, Slot>>,
}

#[derive(Debug)]
enum Slot {
    Live(Arc<FileEntry>),
    /// Deregistered through the engine: its descriptor may be closed or reused by now.
    Gone,
}

impl FileTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<EndpointId, Slot>> {
        // Every critical section is a single map operation: a poisoned map is still consistent.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Inspects file endpoint `id`, just registered, and remembers it.
    pub(crate) fn register(&self, id: EndpointId, range: FileRange) -> io::Result<()> {
        let entry = Arc::new(FileEntry::inspect(range.fd)?);
        self.lock().insert(id, Slot::Live(entry));
        Ok(())
    }

    /// Forgets `id`, deregistered: no batch uses it any more, and its descriptor may be
    /// closed or reused from now on.
    pub(crate) fn retire(&self, id: EndpointId) {
        self.lock().insert(id, Slot::Gone);
    }

    /// The entry of file endpoint `id`, inspecting a descriptor registered without the engine
    /// on first use.
    pub(crate) fn get(
        &self,
        id: EndpointId,
        range: FileRange,
    ) -> Result<Arc<FileEntry>, FailureCause> {
        if let Some(slot) = self.lock().get(&id) {
            return match slot {
                Slot::Live(entry) => Ok(Arc::clone(entry)),
                Slot::Gone => Err(FailureCause::EndpointGone(id)),
            };
        }
        let entry = FileEntry::inspect(range.fd)
            .map_err(|e| FailureCause::Io { errno: e.raw_os_error().unwrap_or(libc::EBADF) })?;
        let entry = Arc::new(entry);
        let mut slots = self.lock();
        let slot = slots.entry(id).or_insert_with(|| Slot::Live(Arc::clone(&entry)));
        match slot {
            Slot::Live(entry) => Ok(Arc::clone(entry)),
            Slot::Gone => Err(FailureCause::EndpointGone(id)),
        }
    }

    /// What the table knows about `id`, without inspecting anything.
    pub(crate) fn info(&self, id: EndpointId) -> Option<FileInfo> {
        match self.lock().get(&id) {
            Some(Slot::Live(entry)) => Some(entry.info),
            _ => None,
        }
    }
}
