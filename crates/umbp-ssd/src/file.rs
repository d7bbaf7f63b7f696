//! File endpoints: how the engine opens files, and what it knows about each file endpoint.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use umbp_plan::{EndpointId, FailureCause, FileRange};

use crate::sys;

/// How [`SsdEngine::open_file`](crate::SsdEngine::open_file) opens a file.
///
/// Defaults: readable and writable, not created, `O_DIRECT`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FileOptions {
    writable: bool,
    create: bool,
    direct: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl FileOptions {
    /// Read-write, existing file, `O_DIRECT`.
    pub const fn new() -> Self {
        Self { writable: true, create: false, direct: true }
    }

    /// Whether the file is opened for writing as well as reading (default `true`). Writes into a
    /// read-only file endpoint fail with `EBADF` without reaching the kernel.
    pub const fn writable(mut self, writable: bool) -> Self {
        self.writable = writable;
        self
    }

    /// Whether a missing file is created (default `false`; needs `writable`).
    pub const fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Whether to open with `O_DIRECT` (default `true`). Where the filesystem refuses
    /// `O_DIRECT`, the engine opens the file buffered instead and logs that once.
    pub const fn direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }
}

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
    /// Whether the engine opened the file (and closes it at deregistration).
    pub owned: bool,
}

/// A file endpoint as the executors use it. An entry the engine opened owns its descriptor;
/// batches hold the entry while they run, so deregistering closes the file only after the last
/// batch using it is done.
#[derive(Debug)]
pub(crate) struct FileEntry {
    pub(crate) info: FileInfo,
    _owned: Option<OwnedFd>,
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

    /// Inspects a descriptor: its flags and block size.
    fn inspect(fd: RawFd, owned: Option<OwnedFd>) -> io::Result<Self> {
        let flags = sys::status_flags(fd)?;
        let direct = flags & libc::O_DIRECT != 0;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let block_size = sys::logical_block_size(fd);
        let info = FileInfo { fd, direct, block_size, writable, owned: owned.is_some() };
        Ok(Self { info, _owned: owned })
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

    /// Inspects `fd` (owned or not) ready to be registered.
    pub(crate) fn entry_for(fd: RawFd, owned: Option<OwnedFd>) -> io::Result<Arc<FileEntry>> {
        FileEntry::inspect(fd, owned).map(Arc::new)
    }

    pub(crate) fn insert(&self, id: EndpointId, entry: Arc<FileEntry>) {
        self.lock().insert(id, Slot::Live(entry));
    }

    /// Forgets `id`; its descriptor closes once no running batch holds it.
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
        let entry = FileEntry::inspect(range.fd, None)
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

/// Opens `path` as `options` say. Returns the descriptor and whether `O_DIRECT` was refused
/// (and the file opened buffered instead).
pub(crate) fn open(path: &Path, options: &FileOptions) -> io::Result<(OwnedFd, bool)> {
    let mut open = OpenOptions::new();
    open.read(true).write(options.writable).create(options.create);
    if options.direct {
        open.custom_flags(libc::O_DIRECT);
        match open.open(path) {
            Ok(file) => return Ok((file.into(), false)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                open.custom_flags(0);
                return open.open(path).map(|file| (file.into(), true));
            }
            Err(e) => return Err(e),
        }
    }
    open.open(path).map(|file| (file.into(), false))
}
