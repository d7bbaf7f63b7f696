//! Registration: the one way to hand memory and files to an engine or a composite. The
//! story is on [`Register`].
#![allow(unsafe_code)] // `HostMemory` and `register_raw_memory` state promises; `fcntl`, `flock`.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{Endpoint, EndpointId, EndpointRegistry, EngineError, RemoteRegion};

/// Host memory that can be registered without `unsafe`: a buffer that owns its bytes in one
/// heap allocation.
///
/// # Safety
///
/// An implementation promises that, for as long as the value exists and is not accessed
/// through `&mut` (the registration holds it and touches nothing):
/// - `as_mut_ptr() .. + len()` is one allocation of initialised bytes, valid for reads and
///   writes through the returned pointer, and
/// - moving the value does not move those bytes and does not invalidate the pointer (so inline
///   arrays and `Box`, whose moves assert uniqueness, do not qualify; `Vec<u8>` does).
pub unsafe trait HostMemory: Send + 'static {
    /// The first byte.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// How many bytes from [`as_mut_ptr`](Self::as_mut_ptr) are registered.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a `Vec`'s elements live in one heap allocation that moving the `Vec` leaves in place
// and that is not reallocated while nothing calls `&mut` methods on it; `len` bytes are
// initialised.
unsafe impl HostMemory for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        Vec::as_mut_ptr(self)
    }

    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// How [`FileSource::open`] opens a file. Defaults: readable and writable, not created, not
/// extended, `O_DIRECT`, not exclusive.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FileOptions {
    writable: bool,
    create: bool,
    extend: bool,
    direct: bool,
    exclusive: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl FileOptions {
    /// Read-write, existing file, `O_DIRECT`.
    pub const fn new() -> Self {
        Self { writable: true, create: false, extend: false, direct: true, exclusive: false }
    }

    /// Whether the file is opened for writing as well as reading (default `true`). Writes into
    /// a read-only file endpoint fail with `EBADF`.
    pub const fn writable(mut self, writable: bool) -> Self {
        self.writable = writable;
        self
    }

    /// Whether a missing file is created (default `false`; needs `writable`).
    pub const fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Whether a regular file shorter than the registered range is extended to the range's
    /// end when it is registered (default `false`; needs `writable`): the file then holds
    /// every registered byte (zeros, sparse, until written), so a read of bytes no offload
    /// wrote yet returns zeros instead of failing as
    /// [`ShortFile`](crate::FailureCause::ShortFile). A file is never shortened. With
    /// [`create`](Self::create), what makes a new offload tier of its full size in one call.
    pub const fn extend(mut self, extend: bool) -> Self {
        self.extend = extend;
        self
    }

    /// Whether to open with `O_DIRECT` (default `true`). Where the filesystem refuses it
    /// (`EINVAL`, as tmpfs does), the file is opened buffered instead; the registration's
    /// endpoint says which ([`FileRange::direct`](crate::FileRange::direct)).
    pub const fn direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    /// Whether the registration holds an exclusive lock on the file for as long as it lasts
    /// (default `false`): what keeps two instances from using one tier file, each overwriting
    /// the other's slots and serving the other's bytes as its own. The lock is a
    /// `flock(LOCK_EX | LOCK_NB)` on the registration's own open of the file, taken before
    /// anything else touches the file (before [`extend`](Self::extend)); a file some other
    /// open holds locked (another process, another engine of this one, or another
    /// registration of the same path in this process) is refused with
    /// [`RegisterError::Locked`] at once, without waiting. It is released when the
    /// registration ends (dropped or [deregistered](Registration::deregister)), or when the
    /// process dies.
    ///
    /// Locks are advisory: they keep out only those who ask for them. Registrations without
    /// this option neither take nor see the lock (several registrations of one file in one
    /// engine, `O_DIRECT` and buffered, stay possible, and are ordered by the engine).
    pub const fn exclusive(mut self, exclusive: bool) -> Self {
        self.exclusive = exclusive;
        self
    }
}

/// The file behind a file registration: a path to open, or a descriptor the caller opened
/// (a [`File`] or an [`OwnedFd`]; `try_clone_to_owned` makes one from a borrowed descriptor).
/// Either way the registration owns the descriptor and closes it when it ends.
#[derive(Debug)]
pub struct FileSource(Source);

#[derive(Debug)]
enum Source {
    Path(PathBuf, FileOptions),
    Open(File),
}

impl FileSource {
    /// `path`, opened as `options` say.
    pub fn open(path: impl Into<PathBuf>, options: FileOptions) -> Self {
        Self(Source::Path(path.into(), options))
    }

    /// The path, for a source opened by path: what errors name the endpoint by.
    fn path(&self) -> Option<&Path> {
        match &self.0 {
            Source::Path(path, _) => Some(path),
            Source::Open(_) => None,
        }
    }

    /// The open file, checked to hold `file_offset .. end` (or extended to, as the options
    /// say; see [`Register::register_file`]), whether its descriptor has `O_DIRECT`, and
    /// whether it holds the file's exclusive lock ([`FileOptions::exclusive`]).
    fn into_file(self, file_offset: u64, end: u64) -> Result<(File, bool, bool), RegisterError> {
        let (file, direct, writable, extend, locked) = match self.0 {
            Source::Path(path, options) => {
                let (file, direct) = match open(&path, &options) {
                    Ok(opened) => opened,
                    Err(source) => return Err(RegisterError::Open { path, source }),
                };
                if options.exclusive {
                    lock_exclusive(&file).map_err(|source| match source.raw_os_error() {
                        Some(libc::EWOULDBLOCK) => RegisterError::Locked { path, source },
                        _ => RegisterError::Inspect { fd: file.as_raw_fd(), source },
                    })?;
                }
                (file, direct, options.writable, options.extend, options.exclusive)
            }
            Source::Open(file) => {
                let fd = file.as_raw_fd();
                // SAFETY: `F_GETFL` reads the descriptor's status flags and touches no memory;
                // `fd` is open for as long as `file` lives.
                let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
                if flags < 0 {
                    return Err(RegisterError::Inspect { fd, source: io::Error::last_os_error() });
                }
                let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
                (file, flags & libc::O_DIRECT != 0, writable, false, false)
            }
        };
        let inspect = |source| RegisterError::Inspect { fd: file.as_raw_fd(), source };
        let Some(file_len) = size(&file).map_err(inspect)? else {
            return Ok((file, direct, locked));
        };
        if end > file_len {
            if extend && writable {
                file.set_len(end).map_err(|source| RegisterError::Extend { len: end, source })?;
            } else if !writable {
                let len = end - file_offset;
                return Err(RegisterError::PastEnd { file_offset, len, file_len });
            }
        }
        Ok((file, direct, locked))
    }
}

impl From<&Path> for FileSource {
    /// The path, opened with the default [`FileOptions`].
    fn from(path: &Path) -> Self {
        Self::open(path, FileOptions::new())
    }
}

impl From<PathBuf> for FileSource {
    /// The path, opened with the default [`FileOptions`].
    fn from(path: PathBuf) -> Self {
        Self::open(path, FileOptions::new())
    }
}

impl From<File> for FileSource {
    fn from(file: File) -> Self {
        Self(Source::Open(file))
    }
}

impl From<OwnedFd> for FileSource {
    fn from(fd: OwnedFd) -> Self {
        Self(Source::Open(File::from(fd)))
    }
}

/// How many bytes `file` holds, if it has a size: a regular file's length, a block device's
/// capacity; `None` for what has none (a pipe, a character device).
fn size(file: &File) -> io::Result<Option<u64>> {
    let kind = file.metadata()?;
    if kind.is_file() {
        Ok(Some(kind.len()))
    } else if kind.file_type().is_block_device() {
        // A block device's `st_size` is 0; its end is its capacity. Engines address the
        // descriptor with explicit offsets, so moving its position changes nothing.
        let mut file = file;
        file.seek(SeekFrom::End(0)).map(Some)
    } else {
        Ok(None)
    }
}

/// Takes an exclusive `flock` on `file`'s open file description without waiting
/// ([`FileOptions::exclusive`]): `EWOULDBLOCK` when another open of the file holds one. It
/// lasts until [`unlock`] or until every descriptor of this open is closed.
fn lock_exclusive(file: &File) -> io::Result<()> {
    // SAFETY: `flock` takes a descriptor and a flag and touches no memory; the descriptor is
    // open for as long as `file` lives.
    match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Releases a lock [`lock_exclusive`] took on `fd` (nothing if it took none).
fn unlock(fd: RawFd) {
    // SAFETY: as in `lock_exclusive`; the caller keeps `fd` open across the call.
    unsafe { libc::flock(fd, libc::LOCK_UN) };
}

/// Opens `path`; with `O_DIRECT` refused by the filesystem, opens it buffered. Returns the file
/// and whether it has `O_DIRECT`.
fn open(path: &Path, options: &FileOptions) -> io::Result<(File, bool)> {
    let mut open = OpenOptions::new();
    open.read(true).write(options.writable).create(options.create);
    if options.direct {
        open.custom_flags(libc::O_DIRECT);
        match open.open(path) {
            Ok(file) => return Ok((file, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(path = %path.display(), "the filesystem refuses O_DIRECT; buffered");
                open.custom_flags(0);
            }
            Err(e) => return Err(e),
        }
    }
    open.open(path).map(|file| (file, false))
}

/// Why a registration was refused. Nothing of it remains registered.
///
/// `Display` gives this error's own words; a cause (the system's error, an engine's) is its
/// [`source`](std::error::Error::source), to print after it (anyhow's `{:#}` does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// [`register_raw_memory`](Register::register_raw_memory) was given a file endpoint.
    #[error("a file endpoint is registered with register_file, not as memory")]
    NotMemory,
    /// The memory region wraps around the address space.
    #[error("the region at {addr:#x} of {len} bytes wraps around the address space")]
    RegionOverflow {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The file range's (or remote range's) end overflows `u64`.
    #[error("the range at {file_offset} of {len} bytes overflows")]
    RangeOverflow {
        /// Start offset (in the file, or in the remote region).
        file_offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The file could not be opened.
    #[error("could not open {path}")]
    Open {
        /// The path.
        path: PathBuf,
        /// What the system said.
        source: io::Error,
    },
    /// A registration that cannot write the file names bytes past its end (or its device's):
    /// no transfer could ever read them. A writable one may (see
    /// [`register_file`](Register::register_file)).
    #[error(
        "the range at {file_offset} of {len} bytes ends past the end of the file ({file_len} bytes)"
    )]
    PastEnd {
        /// Start offset in the file.
        file_offset: u64,
        /// Length in bytes.
        len: u64,
        /// The file's length when it was registered.
        file_len: u64,
    },
    /// The registration asked for the file to itself ([`FileOptions::exclusive`]) and another
    /// open of it holds it: another process, or another engine or registration of this one,
    /// uses the same file. Two instances must never share a tier file: each would overwrite
    /// the other's slots and serve them as its own.
    #[error(
        "{path} is locked by another process or engine instance using it as its tier file; \
         two instances must not share one: give each instance its own path (for example, put \
         the instance's data-parallel rank, port or another name that tells instances apart \
         into the file name)"
    )]
    Locked {
        /// The path.
        path: PathBuf,
        /// What the system said (`EWOULDBLOCK`).
        source: io::Error,
    },
    /// The file could not be extended to the registered range
    /// ([`FileOptions::extend`]).
    #[error("could not extend the file to {len} bytes")]
    Extend {
        /// The length it was to have.
        len: u64,
        /// What the system said.
        source: io::Error,
    },
    /// A descriptor could not be inspected (its flags, its block size, its length).
    #[error("could not inspect descriptor {fd}")]
    Inspect {
        /// The descriptor.
        fd: i32,
        /// What the system said.
        source: io::Error,
    },
    /// An engine refused to prepare the endpoint (pinning failed, say).
    #[error("engine `{engine}` refused the endpoint")]
    Engine {
        /// The engine's name.
        engine: String,
        /// The engine's own error; downcast it for details.
        source: EngineError,
    },
}

/// Undoes what an engine prepared for an endpoint; see [`Register::prepare`].
pub trait EndpointRelease: Send + Sync {
    /// Called once, after endpoint `id` was deregistered and no batch uses it any more.
    fn release(&self, id: EndpointId);
}

/// A registered endpoint and what backs it (`K`: the buffer, the file, or `()` for raw
/// memory). Dropping it deregisters the endpoint; see [`Register`].
#[must_use = "dropping a registration deregisters the endpoint at once"]
pub struct Registration<K = ()> {
    id: EndpointId,
    endpoint: Endpoint,
    registry: Arc<EndpointRegistry>,
    release: Option<Arc<dyn EndpointRelease>>,
    /// The descriptor whose exclusive lock ([`FileOptions::exclusive`]) the registration holds,
    /// released by `deregister` before it hands the file back (closing it releases it too).
    locked: Option<RawFd>,
    /// `None` only after `deregister` took it.
    keep: Option<K>,
}

impl<K> Registration<K> {
    /// The endpoint's id: what fragments and objects name it by. Once the registration ends,
    /// the id is unknown (a slot is reused only under a new generation, so the old id never
    /// names another endpoint), so transfers naming it fail as
    /// [`EndpointGone`](crate::FailureCause::EndpointGone) and never touch other memory.
    pub fn id(&self) -> EndpointId {
        self.id
    }

    /// The endpoint as registered: kind, address and length.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Names the endpoint `label` in errors (`"kv-cache"` instead of `endpoint 3`), replacing
    /// the name it had (a file registered by path is named by its path). Any string; it need
    /// not be unique. The name goes when the registration ends.
    ///
    /// ```
    /// use umbp_plan::{EndpointRegistry, Register};
    ///
    /// let registry = EndpointRegistry::new();
    /// let kv = registry.register_memory(vec![0u8; 4096])?;
    /// kv.set_label("kv-cache");
    /// assert_eq!(kv.label().as_deref(), Some("kv-cache"));
    /// # Ok::<(), umbp_plan::RegisterError>(())
    /// ```
    pub fn set_label(&self, label: impl AsRef<str>) {
        self.registry.set_name(self.id, Arc::from(label.as_ref()));
    }

    /// What errors call the endpoint: the label given with [`set_label`](Self::set_label),
    /// else the path of a file registered by path; `None` otherwise.
    pub fn label(&self) -> Option<Arc<str>> {
        self.registry.name(self.id)
    }

    /// Ends the registration (waiting for the batches in flight that use it, then releasing
    /// what engines held for it) and hands back what backed it: the buffer, to read what the
    /// transfers wrote, or the file.
    pub fn deregister(mut self) -> K {
        self.end();
        if let Some(fd) = self.locked.take() {
            // `keep`, the file, holds `fd` open until after this.
            unlock(fd);
        }
        self.keep.take().expect("a registration is deregistered once")
    }

    fn end(&mut self) {
        // Fails only if the id was already deregistered through the registry directly; no
        // batch uses it either way.
        let _ = self.registry.deregister(self.id);
        if let Some(release) = self.release.take() {
            release.release(self.id);
        }
    }
}

impl<K> Drop for Registration<K> {
    fn drop(&mut self) {
        if self.keep.is_some() {
            self.end();
        }
        // `keep` (the buffer, the descriptor) is dropped after this, once nothing uses it.
    }
}

impl<K> std::fmt::Debug for Registration<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// Registration, the same for every engine and the composite.
///
/// Every engine and the composite implement this trait, so registering looks the same
/// everywhere: [`register_memory`](Register::register_memory) for host memory Rust owns (safe),
/// [`register_raw_memory`](Register::register_raw_memory) for memory only the caller can vouch
/// for (`unsafe`: a raw pointer, device memory, a tensor), and
/// [`register_file`](Register::register_file) for a file, by path or by descriptor. Each returns
/// a [`Registration`]: it names the endpoint ([`Registration::id`]) and keeps what backs it alive
/// (the buffer, the descriptor). Dropping it deregisters the endpoint, which waits for the
/// batches in flight that use it ([`EndpointRegistry::deregister`]), lets the engines release
/// what they held for it (a pinning, a file entry), and only then frees the buffer or closes
/// the descriptor. [`Registration::deregister`] does the same and hands the buffer back.
///
/// Why registrations own their memory instead of borrowing it: a guard that borrowed a buffer
/// could be leaked with `std::mem::forget`, ending the borrow while the endpoint stays
/// registered, and a later transfer would write into freed memory from safe code. An owned
/// buffer cannot be freed while the guard that owns it exists, leaked or not.
///
/// An engine implements [`registry`](Self::registry) and [`prepare`](Self::prepare); callers
/// use the three `register_*` methods.
pub trait Register {
    /// The registry the endpoints are named in.
    fn registry(&self) -> &Arc<EndpointRegistry>;

    /// Prepares for endpoint `id`, just registered (pins host memory for a device, inspects a
    /// file), and returns what undoes that when the registration ends, if anything does. An
    /// error undoes the registration. Called by the `register_*` methods, not by callers.
    fn prepare(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError>;

    /// Registers host memory Rust owns ([`Vec<u8>`], [`AlignedBuffer`](crate::AlignedBuffer)).
    /// The registration keeps it until it ends; [`Registration::deregister`] hands it back.
    fn register_memory<M: HostMemory>(
        &self,
        mut memory: M,
    ) -> Result<Registration<M>, RegisterError>
    where
        Self: Sized,
    {
        let len = memory.len() as u64;
        // Exposed, so that engines can rebuild a pointer from the plain address.
        let addr = memory.as_mut_ptr().expose_provenance() as u64;
        let endpoint = Endpoint::host(addr, len);
        // SAFETY: `HostMemory` promises `addr .. + len` valid for reads and writes while
        // `memory` lives untouched; the registration owns it, touches nothing, and drops it
        // only after deregistering (which waits for every batch that uses it).
        let id = unsafe { self.registry().register(endpoint) };
        finish(self, id, endpoint, memory)
    }

    /// Registers memory described by `endpoint` (host or device) that only the caller can
    /// vouch for: a raw pointer, device memory, a tensor's storage.
    ///
    /// # Safety
    ///
    /// Engines read and write `addr .. addr + len` after checking only that each access lies
    /// inside it. The caller promises that it is memory of the endpoint's kind, valid for
    /// reads and writes until the registration has ended (dropped or
    /// [deregistered](Registration::deregister)), and that while a transfer runs nothing else
    /// accesses the bytes it writes or writes the bytes it reads.
    unsafe fn register_raw_memory(&self, endpoint: Endpoint) -> Result<Registration, RegisterError>
    where
        Self: Sized,
    {
        if endpoint.file_range().is_some() {
            return Err(RegisterError::NotMemory);
        }
        let (addr, len) = (endpoint.addr(), endpoint.len());
        if addr.checked_add(len).is_none() {
            return Err(RegisterError::RegionOverflow { addr, len });
        }
        // SAFETY: the caller's promise is the registry's.
        let id = unsafe { self.registry().register(endpoint) };
        finish(self, id, endpoint, ())
    }

    /// Registers bytes `file_offset .. file_offset + len` of a file: a path (opened with the
    /// default [`FileOptions`], or as [`FileSource::open`] says) or a descriptor. The
    /// registration owns the descriptor and closes it when it ends; whether transfers align for
    /// `O_DIRECT` follows the descriptor's flags.
    ///
    /// Past the end of the file:
    /// - a registration that cannot write the file (opened with
    ///   [`writable(false)`](FileOptions::writable), or a read-only descriptor) is refused
    ///   with [`RegisterError::PastEnd`]: no transfer could ever read those bytes;
    /// - a writable one is accepted: it is how an offload tier starts on an empty or short file
    ///   (offloads write it and the file grows). Until a byte is written, a read of it fails
    ///   with [`ShortFile`](crate::FailureCause::ShortFile), as a read of a file truncated
    ///   after registering does. [`FileOptions::extend`] sizes the file to the range at
    ///   registration instead (the caller may as well size it first, `File::set_len`).
    ///
    /// The length checked is a regular file's, or a block device's capacity; pipes and
    /// character devices have none and are not checked.
    fn register_file(
        &self,
        file: impl Into<FileSource>,
        file_offset: u64,
        len: u64,
    ) -> Result<Registration<File>, RegisterError>
    where
        Self: Sized,
    {
        if file_offset.checked_add(len).is_none() {
            return Err(RegisterError::RangeOverflow { file_offset, len });
        }
        let source = file.into();
        let path: Option<Arc<str>> = source.path().map(|p| Arc::from(p.to_string_lossy()));
        let (file, direct, locked) = source.into_file(file_offset, file_offset + len)?;
        let fd = file.as_raw_fd();
        let endpoint = Endpoint::file(fd, file_offset, len, direct);
        let id = self.registry().insert(endpoint);
        if let Some(path) = path {
            self.registry().set_name(id, path);
        }
        let mut registration = finish(self, id, endpoint, file)?;
        registration.locked = locked.then_some(fd);
        Ok(registration)
    }

    /// Registers bytes `offset .. offset + len` of a region another node exported, as a
    /// remote engine's connection listed it. Safe: nothing in this process is dereferenced
    /// through it, and the engine that owns the peer refuses (in
    /// [`prepare`](Self::prepare)) a region it does not know or a range past the export, so
    /// a remote endpoint can only ever name bytes the peer handed out. Through a registry or
    /// an engine that knows no remote peer, the endpoint registers but no engine carries it.
    fn register_remote(
        &self,
        region: RemoteRegion,
        offset: u64,
        len: u64,
    ) -> Result<Registration, RegisterError>
    where
        Self: Sized,
    {
        if offset.checked_add(len).is_none() {
            return Err(RegisterError::RangeOverflow { file_offset: offset, len });
        }
        let endpoint = Endpoint::remote(region, offset, len);
        let id = self.registry().insert(endpoint);
        finish(self, id, endpoint, ())
    }
}

/// Prepares the engines for `id` and wraps it in its guard, or undoes the registration.
fn finish<R: Register, K>(
    this: &R,
    id: EndpointId,
    endpoint: Endpoint,
    keep: K,
) -> Result<Registration<K>, RegisterError> {
    let registry = Arc::clone(this.registry());
    match this.prepare(id, &endpoint) {
        Ok(release) => {
            Ok(Registration { id, endpoint, registry, release, locked: None, keep: Some(keep) })
        }
        Err(e) => {
            // Nothing was submitted against it yet; `keep` goes after this.
            let _ = registry.deregister(id);
            Err(e)
        }
    }
}

/// The registry alone registers without preparing any engine: for engines that need no
/// preparation, and for tests.
impl Register for Arc<EndpointRegistry> {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        self
    }

    fn prepare(
        &self,
        _: EndpointId,
        _: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;

    use super::*;
    use crate::AlignedBuffer;

    /// An engine that refuses endpoints longer than its limit and counts releases.
    struct Picky {
        registry: Arc<EndpointRegistry>,
        limit: u64,
        released: Arc<Released>,
    }

    #[derive(Default)]
    struct Released(Mutex<Vec<EndpointId>>);

    impl EndpointRelease for Released {
        fn release(&self, id: EndpointId) {
            self.0.lock().unwrap().push(id);
        }
    }

    impl Register for Picky {
        fn registry(&self) -> &Arc<EndpointRegistry> {
            &self.registry
        }

        fn prepare(
            &self,
            _: EndpointId,
            endpoint: &Endpoint,
        ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
            if endpoint.len() > self.limit {
                let source: EngineError = "too long".into();
                return Err(RegisterError::Engine { engine: "picky".into(), source });
            }
            Ok(Some(self.released.clone()))
        }
    }

    #[test]
    fn a_registration_ends_once_and_hands_its_memory_back() {
        let picky =
            Picky { registry: EndpointRegistry::new(), limit: 4096, released: Default::default() };
        let reg = picky.register_memory(vec![7u8; 64]).unwrap();
        let (id, addr) = (reg.id(), reg.endpoint().addr());
        assert_eq!(picky.registry.get(id).map(|e| (e.addr(), e.len())), Some((addr, 64)));
        let back = reg.deregister();
        assert_eq!((back.as_ptr() as u64, back.len()), (addr, 64), "the same buffer, unmoved");
        assert!(picky.registry.get(id).is_none());
        assert_eq!(*picky.released.0.lock().unwrap(), [id], "released once");

        let dropped = picky.register_memory(AlignedBuffer::for_direct_io(4096)).unwrap();
        let id = dropped.id();
        drop(dropped);
        assert!(picky.registry.get(id).is_none());
        assert_eq!(picky.released.0.lock().unwrap().len(), 2);
    }

    #[test]
    #[cfg_attr(miri, ignore = "opens files: Miri isolates the file system and has no O_DIRECT")]
    fn a_refused_registration_leaves_nothing() {
        let picky =
            Picky { registry: EndpointRegistry::new(), limit: 10, released: Default::default() };
        let err = picky.register_memory(vec![0u8; 11]).unwrap_err();
        assert!(matches!(err, RegisterError::Engine { .. }), "{err:?}");
        assert_eq!(picky.registry.snapshot().iter().count(), 0);
        // SAFETY: refused before anything could use it.
        let raw = unsafe { picky.register_raw_memory(Endpoint::host(u64::MAX - 1, 4)) };
        assert!(matches!(raw, Err(RegisterError::RegionOverflow { .. })));
        // SAFETY: refused: not memory.
        let file = unsafe { picky.register_raw_memory(Endpoint::file(0, 0, 1, false)) };
        assert!(matches!(file, Err(RegisterError::NotMemory)));
        let overflow = picky.register_file(Path::new("/nonexistent"), u64::MAX, 1);
        assert!(matches!(overflow, Err(RegisterError::RangeOverflow { .. })));
        let missing = picky.register_file(Path::new("/nonexistent/umbp"), 0, 1).unwrap_err();
        assert!(matches!(missing, RegisterError::Open { .. }), "{missing:?}");
        // Its words, and the system's as its source, once each in a printed chain.
        assert_eq!(missing.to_string(), "could not open /nonexistent/umbp");
        let cause = std::error::Error::source(&missing).expect("the system's error").to_string();
        assert!(cause.contains("No such file"), "{cause}");
        assert_eq!(picky.registry.snapshot().iter().count(), 0);
        assert!(picky.released.0.lock().unwrap().is_empty());
    }

    #[test]
    #[cfg_attr(miri, ignore = "opens files: Miri isolates the file system and has no O_DIRECT")]
    fn a_file_registration_owns_its_descriptor_until_it_ends() {
        let dir = std::env::temp_dir().join(format!("umbp-register-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, [1u8; 8192]).unwrap();
        let registry = EndpointRegistry::new();
        let reg = registry
            .register_file(FileSource::open(&path, FileOptions::new().direct(false)), 4096, 4096)
            .unwrap();
        let range = reg.endpoint().file_range().unwrap();
        assert_eq!((range.file_offset, range.direct), (4096, false));
        assert_eq!(registry.get(reg.id()).and_then(|e| e.file_range()), Some(range));
        let file = reg.deregister();
        assert_eq!(file.as_raw_fd(), range.fd, "the descriptor comes back open");
        assert_eq!(file.metadata().unwrap().len(), 8192);

        // From a descriptor the caller opened: its own flags decide.
        let opened = File::open(&path).unwrap();
        let reg = registry.register_file(opened, 0, 8192).unwrap();
        assert!(!reg.endpoint().file_range().unwrap().direct);
        drop(reg);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "opens files: Miri isolates the file system and has no O_DIRECT")]
    fn a_range_past_the_end_is_refused_unless_the_registration_can_write_it() {
        let dir = std::env::temp_dir().join(format!("umbp-past-end-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, [1u8; 8192]).unwrap();
        let registry = EndpointRegistry::new();
        let read_only = || FileSource::open(&path, FileOptions::new().writable(false));

        // Read-only, by path or by descriptor: the range must lie inside the file.
        let whole = registry.register_file(read_only(), 4096, 4096).unwrap();
        for (offset, len) in [(4096, 4097), (8192, 1), (0, 1 << 40)] {
            let err = registry.register_file(read_only(), offset, len).unwrap_err();
            assert!(
                matches!(err, RegisterError::PastEnd { file_offset, len: l, file_len: 8192 }
                    if file_offset == offset && l == len),
                "{err:?}"
            );
            let err = registry.register_file(File::open(&path).unwrap(), offset, len);
            assert!(matches!(err, Err(RegisterError::PastEnd { .. })), "{err:?}");
        }
        // `extend` cannot write a read-only file either.
        let extended = FileSource::open(&path, FileOptions::new().writable(false).extend(true));
        let err = registry.register_file(extended, 0, 8193);
        assert!(matches!(err, Err(RegisterError::PastEnd { .. })), "{err:?}");
        assert_eq!(registry.snapshot().iter().count(), 1, "refusals leave nothing registered");
        drop(whole);

        // Writable: an offload tier may start on a short file, which stays as it is ...
        let plain = FileSource::open(&path, FileOptions::new().direct(false));
        let tier = registry.register_file(plain, 0, 1 << 20).unwrap();
        assert_eq!(tier.deregister().metadata().unwrap().len(), 8192);
        // ... or be sized to the range (never shortened).
        let extend = || FileSource::open(&path, FileOptions::new().direct(false).extend(true));
        let tier = registry.register_file(extend(), 4096, 1 << 20).unwrap();
        assert_eq!(tier.deregister().metadata().unwrap().len(), 4096 + (1 << 20));
        let shorter = registry.register_file(extend(), 0, 4096).unwrap();
        assert_eq!(shorter.deregister().metadata().unwrap().len(), 4096 + (1 << 20));
        let fresh = FileSource::open(
            dir.join("new"),
            FileOptions::new().direct(false).create(true).extend(true),
        );
        let tier = registry.register_file(fresh, 0, 12_345).unwrap();
        assert_eq!(tier.deregister().metadata().unwrap().len(), 12_345);

        // What has no length (a character device) is not checked.
        let null = registry.register_file(File::open("/dev/null").unwrap(), 0, 1 << 20);
        assert!(null.is_ok(), "{null:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[cfg_attr(miri, ignore = "opens files: Miri isolates the file system")]
    fn an_exclusive_registration_keeps_every_other_exclusive_one_off_its_file_until_it_ends() {
        let dir = std::env::temp_dir().join(format!("umbp-exclusive-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tier");
        std::fs::write(&path, [0u8; 8192]).unwrap();
        let registry = EndpointRegistry::new();
        let exclusive =
            || FileSource::open(&path, FileOptions::new().direct(false).exclusive(true));
        // Another process asking for the lock: `flock(1)`, where the system has it.
        let other_process_locks = || {
            let status = std::process::Command::new("flock")
                .args(["--nonblock", "--exclusive"])
                .arg(&path)
                .arg("true")
                .status();
            match status {
                Ok(status) => Some(status.success()),
                Err(e) => {
                    eprintln!("SKIP the other-process part: no flock(1) here: {e}");
                    None
                }
            }
        };

        let first = registry.register_file(exclusive(), 0, 8192).unwrap();
        // A second exclusive registration of the path, in this process (as a second engine
        // instance would make): refused at once, in words, leaving nothing registered.
        let err = registry.register_file(exclusive(), 0, 4096).unwrap_err();
        assert!(matches!(&err, RegisterError::Locked { path: p, .. } if *p == path), "{err:?}");
        let words = err.to_string();
        assert!(words.contains("locked by another process or engine instance"), "{words}");
        assert!(words.contains("give each instance its own path"), "{words}");
        assert_eq!(registry.snapshot().iter().count(), 1);
        assert_ne!(other_process_locks(), Some(true), "another process took the lock");
        // Registrations that do not ask for the lock are not refused (advisory lock).
        let plain = FileSource::open(&path, FileOptions::new().direct(false));
        drop(registry.register_file(plain, 0, 4096).unwrap());

        // Deregistering releases it, though the file handed back stays open.
        let file = first.deregister();
        assert_ne!(other_process_locks(), Some(false), "released at deregistration");
        let second = registry.register_file(exclusive(), 0, 8192).unwrap();
        drop(file);
        // Dropping releases it too.
        drop(second);
        drop(registry.register_file(exclusive(), 0, 8192).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dropping_a_registration_waits_for_the_batch_that_pins_it() {
        let registry = EndpointRegistry::new();
        let reg = registry.register_memory(vec![0u8; 16]).unwrap();
        let pins = registry.pin([reg.id()]);
        let ended = AtomicU32::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                drop(reg);
                ended.store(1, Ordering::SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert_eq!(ended.load(Ordering::SeqCst), 0, "ended while a batch pins it");
            drop(pins);
        });
        assert_eq!(ended.load(Ordering::SeqCst), 1);
    }
}
