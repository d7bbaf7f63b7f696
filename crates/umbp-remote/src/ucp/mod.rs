//! Safe wrappers over the UCP calls the crate makes; with [`sys`], the only place with
//! `unsafe` code.
//!
//! Every UCX object here is owned by one thread (UCX runs single-threaded workers:
//! `UCS_THREAD_MODE_SINGLE`), which is why none of the types is `Send`: the engine's progress
//! thread and the server's thread each create and drop their own. Lifetimes follow UCX's
//! rules through reference counts: a worker keeps its context alive, an endpoint its worker,
//! a memory mapping its context, and an endpoint destroys its remote keys before it closes.
//!
//! Completions reach the owning thread through [`take_events`]: UCX calls the callbacks below
//! from inside [`Worker::progress`] on that same thread, and they only append to a
//! thread-local list.

pub(crate) mod sys;

use std::cell::RefCell;
use std::ffi::{c_void, CStr, CString};
use std::ptr;
use std::rc::Rc;
use std::sync::OnceLock;
use std::time::Duration;

use crate::Error;

/// UCX, loaded once per process.
fn api() -> Result<&'static sys::Api, Error> {
    static API: OnceLock<Result<sys::Api, String>> = OnceLock::new();
    API.get_or_init(sys::Api::load).as_ref().map_err(|e| Error::LibraryMissing(e.clone()))
}

/// Whether UCX's libraries can be loaded here (for tests that skip without them).
pub(crate) fn available() -> Result<(), Error> {
    api().map(|_| ())
}

/// UCX's own words for `status`.
pub(crate) fn status_message(status: sys::Status) -> String {
    match api() {
        Ok(api) => {
            // SAFETY: ucs_status_string accepts any status and returns a static C string.
            let text = unsafe { (api.ucs_status_string)(status) };
            if text.is_null() {
                format!("status {status}")
            } else {
                // SAFETY: non-null, NUL-terminated and static (UCX's string table).
                unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
            }
        }
        Err(_) => format!("status {status}"),
    }
}

fn check(op: &'static str, status: sys::Status) -> Result<(), Error> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(Error::Ucx { op, status: status.into(), message: status_message(status) })
    }
}

/// What a completion callback or an endpoint's error handler reported.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Event {
    /// A request finished with `status` (`UCS_OK` or an error); `user_data` is what it was
    /// posted with. The request is freed already.
    Done { user_data: u64, status: sys::Status },
    /// The endpoint created with error argument `arg` failed with `status`.
    EndpointFailed { arg: usize, status: sys::Status },
}

thread_local! {
    static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

/// Moves the events reported on this thread since the last call into `into`.
pub(crate) fn take_events(into: &mut Vec<Event>) {
    EVENTS.with(|events| into.append(&mut events.borrow_mut()));
}

/// Called by UCX from inside `ucp_worker_progress` when a request completes.
unsafe extern "C" fn on_request_done(request: *mut c_void, status: sys::Status, data: *mut c_void) {
    let user_data = data as u64;
    EVENTS.with(|events| events.borrow_mut().push(Event::Done { user_data, status }));
    if let Ok(api) = api() {
        // SAFETY: `request` is the request this callback is for; UCX allows releasing it from
        // its own callback, and nothing keeps it (the user data identifies the operation).
        unsafe { (api.ucp_request_free)(request) };
    }
}

/// Called by UCX from inside `ucp_worker_progress` when an endpoint fails.
unsafe extern "C" fn on_endpoint_failed(arg: *mut c_void, _ep: sys::Ep, status: sys::Status) {
    let arg = arg as usize;
    EVENTS.with(|events| events.borrow_mut().push(Event::EndpointFailed { arg, status }));
}

/// What posting a request gave.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Posted {
    /// Completed in place: no callback will come.
    Done,
    /// In flight: an [`Event::Done`] with the request's user data will come.
    Pending,
    /// Refused at once with this status: no callback will come.
    Failed(sys::Status),
}

fn posted(status: sys::StatusPtr) -> Posted {
    let raw = status as isize;
    if status.is_null() {
        Posted::Done
    } else if (sys::UCS_ERR_LAST..0).contains(&raw) {
        Posted::Failed(raw as sys::Status)
    } else {
        Posted::Pending
    }
}

/// A request parameter block that reports completion to [`on_request_done`] with `user_data`.
fn request_param(user_data: u64, memh: sys::MemH) -> sys::RequestParam {
    let mut mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
    if !memh.is_null() {
        mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
    }
    sys::RequestParam {
        op_attr_mask: mask,
        flags: 0,
        request: ptr::null_mut(),
        cb: Some(on_request_done),
        datatype: 0,
        user_data: user_data as *mut c_void,
        reply_buffer: ptr::null_mut(),
        memory_type: 0,
        recv_info: ptr::null_mut(),
        memh,
    }
}

/// What a context is for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Features {
    /// Posting one-sided gets and puts (the engine): RMA and wakeup.
    Initiator,
    /// Only being the target of the NIC's one-sided operations (a server on RDMA): no RMA
    /// feature, so UCX installs none of its software handlers for one-sided operations,
    /// which would write wherever a peer's forged key says. Active messages (unused) and
    /// wakeup, as UCX needs some feature.
    TargetOnly,
}

/// A UCP context.
pub(crate) struct Context {
    api: &'static sys::Api,
    raw: sys::Context,
}

impl Context {
    /// A context for `features`; `transports` overrides `UCX_TLS` when given (`tcp`, `sm`,
    /// `rc,sm`...).
    pub(crate) fn new(transports: Option<&str>, features: Features) -> Result<Rc<Self>, Error> {
        let api = api()?;
        let mut config: sys::Config = ptr::null_mut();
        // SAFETY: null prefix and file mean "the UCX_ environment"; `config` is written.
        check("ucp_config_read", unsafe {
            (api.ucp_config_read)(ptr::null(), ptr::null(), &mut config)
        })?;
        let mut result = Ok(());
        if let Some(transports) = transports {
            let value = CString::new(transports).map_err(|_| Error::Config {
                setting: "transports",
                reason: "contains a NUL byte".into(),
            })?;
            // SAFETY: `config` is live; both strings are NUL-terminated and outlive the call.
            result = check("ucp_config_modify(TLS)", unsafe {
                (api.ucp_config_modify)(config, c"TLS".as_ptr(), value.as_ptr())
            });
        }
        let params = sys::Params {
            field_mask: sys::UCP_PARAM_FIELD_FEATURES,
            features: match features {
                Features::Initiator => sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP,
                Features::TargetOnly => sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP,
            },
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: ptr::null(),
        };
        let mut raw: sys::Context = ptr::null_mut();
        if result.is_ok() {
            let (major, minor) = sys::API_VERSION;
            // SAFETY: `params` and `config` are valid for the call; `raw` is written.
            result = check("ucp_init", unsafe {
                (api.ucp_init_version)(major, minor, &params, config, &mut raw)
            });
        }
        // SAFETY: `config` came from ucp_config_read and is released once; ucp_init copied it.
        unsafe { (api.ucp_config_release)(config) };
        result.map(|()| Rc::new(Self { api, raw }))
    }

    /// Registers `len` bytes at `addr`: for this process's own requests (`Access::Local`), or
    /// for peers to read (and write) through its packed key.
    ///
    /// # Safety
    ///
    /// `addr .. addr + len` is memory of this process that stays mapped until the mapping is
    /// dropped. With remote access, peers given its key may read it (and write it, for
    /// `RemoteWrite`) at any time meanwhile.
    pub(crate) unsafe fn map(
        self: &Rc<Self>,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<MemMap, Error> {
        let mut prot = sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE;
        if access != Access::Local {
            prot |= sys::UCP_MEM_MAP_PROT_REMOTE_READ;
        }
        if access == Access::RemoteWrite {
            prot |= sys::UCP_MEM_MAP_PROT_REMOTE_WRITE;
        }
        let params = sys::MemMapParams {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
            address: addr as *mut c_void,
            length: len as usize,
            flags: 0,
            prot,
            memory_type: 0,
        };
        let mut memh: sys::MemH = ptr::null_mut();
        // SAFETY: the context is live; the caller vouches for the range; `memh` is written.
        check("ucp_mem_map", unsafe { (self.api.ucp_mem_map)(self.raw, &params, &mut memh) })?;
        Ok(MemMap { context: Rc::clone(self), raw: memh })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and mapping holds an `Rc` of this context, so none is left.
        unsafe { (self.api.ucp_cleanup)(self.raw) };
    }
}

/// Who may reach memory registered with [`Context::map`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// This process's requests only.
    Local,
    /// Peers may read it.
    RemoteRead,
    /// Peers may read and write it.
    RemoteWrite,
}

/// Memory registered with [`Context::map`].
pub(crate) struct MemMap {
    context: Rc<Context>,
    raw: sys::MemH,
}

impl MemMap {
    /// The packed remote key that lets a peer reach this memory.
    pub(crate) fn pack(&self) -> Result<Vec<u8>, Error> {
        let api = self.context.api;
        let (mut buffer, mut len) = (ptr::null_mut::<c_void>(), 0usize);
        // SAFETY: context and handle are live; `buffer` and `len` are written.
        check("ucp_rkey_pack", unsafe {
            (api.ucp_rkey_pack)(self.context.raw, self.raw, &mut buffer, &mut len)
        })?;
        // SAFETY: UCX wrote `len` bytes at `buffer`, which stays valid until released below.
        let packed = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), len) }.to_vec();
        // SAFETY: `buffer` came from ucp_rkey_pack and is released once.
        unsafe { (api.ucp_rkey_buffer_release)(buffer) };
        Ok(packed)
    }

    fn handle(&self) -> sys::MemH {
        self.raw
    }
}

impl Drop for MemMap {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_mem_map on this context and is unmapped once; the
        // owner drops a mapping only once no request of its own uses the memory.
        let status = unsafe { (self.context.api.ucp_mem_unmap)(self.context.raw, self.raw) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %status_message(status), "ucp_mem_unmap failed");
        }
    }
}

/// A single-threaded UCP worker: it progresses every request and endpoint made on it.
pub(crate) struct Worker {
    context: Rc<Context>,
    raw: sys::Worker,
    efd: i32,
}

impl Worker {
    /// A worker on `context`, to be used by this thread only.
    pub(crate) fn new(context: &Rc<Context>) -> Result<Rc<Self>, Error> {
        let params = sys::WorkerParams {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            cpu_mask: [0; 16],
            events: 0,
            user_data: ptr::null_mut(),
            event_fd: 0,
            flags: 0,
            name: ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let api = context.api;
        let mut raw: sys::Worker = ptr::null_mut();
        // SAFETY: the context is live; `params` is valid for the call; `raw` is written.
        check("ucp_worker_create", unsafe {
            (api.ucp_worker_create)(context.raw, &params, &mut raw)
        })?;
        let mut efd = -1;
        // SAFETY: the worker is live; `efd` is written (the context has the wakeup feature).
        let got = check("ucp_worker_get_efd", unsafe { (api.ucp_worker_get_efd)(raw, &mut efd) });
        let worker = Self { context: Rc::clone(context), raw, efd };
        got.map(|()| Rc::new(worker))
    }

    /// The worker's address, which a peer needs to connect to it.
    pub(crate) fn address(&self) -> Result<Vec<u8>, Error> {
        let api = self.context.api;
        let (mut address, mut len) = (ptr::null_mut::<c_void>(), 0usize);
        // SAFETY: the worker is live; `address` and `len` are written.
        check("ucp_worker_get_address", unsafe {
            (api.ucp_worker_get_address)(self.raw, &mut address, &mut len)
        })?;
        // SAFETY: UCX wrote `len` bytes at `address`, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
        // SAFETY: `address` came from this worker's ucp_worker_get_address; released once.
        unsafe { (api.ucp_worker_release_address)(self.raw, address) };
        Ok(bytes)
    }

    /// Progresses communication; returns how many events it handled. Callbacks run inside.
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: the worker is live and used by its own thread only (the type is not Send).
        unsafe { (self.context.api.ucp_worker_progress)(self.raw) }
    }

    /// Sleeps until the worker has something to do or `timeout` passes. Returns at once if
    /// events are pending (the caller progresses again).
    pub(crate) fn wait(&self, timeout: Duration) {
        // SAFETY: the worker is live and has the wakeup feature.
        let armed = unsafe { (self.context.api.ucp_worker_arm)(self.raw) };
        if armed == sys::UCS_ERR_BUSY {
            return; // Events are pending: progress again.
        }
        if armed != sys::UCS_OK {
            tracing::debug!(status = %status_message(armed), "ucp_worker_arm failed; polling");
            return;
        }
        let mut fd = libc::pollfd { fd: self.efd, events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut fd, 1, ms) };
    }

    /// Connects to the worker at `address` (a peer's [`Worker::address`]). A failure of the
    /// endpoint later reports [`Event::EndpointFailed`] with `err_arg`.
    pub(crate) fn connect(
        self: &Rc<Self>,
        address: &[u8],
        err_arg: usize,
    ) -> Result<Endpoint, Error> {
        let params = sys::EpParams {
            field_mask: sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ErrHandler {
                cb: Some(on_endpoint_failed),
                arg: err_arg as *mut c_void,
            },
            user_data: ptr::null_mut(),
            flags: 0,
            sockaddr: sys::SockAddr { addr: ptr::null(), addrlen: 0 },
            conn_request: ptr::null_mut(),
            name: ptr::null(),
            local_sockaddr: sys::SockAddr { addr: ptr::null(), addrlen: 0 },
        };
        let mut raw: sys::Ep = ptr::null_mut();
        // SAFETY: the worker is live; `address` holds the bytes of a worker address (UCX
        // parses it and fails on garbage); `raw` is written.
        check("ucp_ep_create", unsafe {
            (self.context.api.ucp_ep_create)(self.raw, &params, &mut raw)
        })?;
        Ok(Endpoint { worker: Rc::clone(self), raw, rkeys: Vec::new(), closed: false })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: every endpoint holds an `Rc` of this worker, so none is left.
        unsafe { (self.context.api.ucp_worker_destroy)(self.raw) };
    }
}

/// A connection to a peer's worker, with the remote keys unpacked on it.
pub(crate) struct Endpoint {
    worker: Rc<Worker>,
    raw: sys::Ep,
    rkeys: Vec<sys::RKey>,
    closed: bool,
}

impl Endpoint {
    /// Unpacks a peer's packed remote key; returns its index for [`get`](Self::get) and
    /// [`put`](Self::put).
    pub(crate) fn unpack(&mut self, packed: &[u8]) -> Result<usize, Error> {
        let mut rkey: sys::RKey = ptr::null_mut();
        // SAFETY: the endpoint is open; UCX reads the packed key (and fails on garbage);
        // `rkey` is written.
        check("ucp_ep_rkey_unpack", unsafe {
            (self.api().ucp_ep_rkey_unpack)(self.raw, packed.as_ptr().cast(), &mut rkey)
        })?;
        self.rkeys.push(rkey);
        Ok(self.rkeys.len() - 1)
    }

    fn api(&self) -> &'static sys::Api {
        self.worker.context.api
    }

    /// A one-sided request of `len` bytes between `local` and `remote` (through key `rkey`):
    /// a put (`local` to `remote`) when `write`, else a get. A put's completion means `local`
    /// may be reused; its bytes are at the peer after a [`flush`](Self::flush).
    ///
    /// # Safety
    ///
    /// `local .. local + len` stays valid (for writes, for a get) and untouched by anything
    /// else (unwritten, for a put) until the request completes (its [`Event::Done`], or
    /// [`Posted::Done`] / [`Posted::Failed`]); `remote .. remote + len` lies inside the region
    /// `rkey` was packed for.
    #[allow(clippy::too_many_arguments)] // The request, flat, as UCX takes it.
    pub(crate) unsafe fn rma(
        &self,
        write: bool,
        rkey: usize,
        local: *mut u8,
        len: u64,
        remote: u64,
        memh: Option<&MemMap>,
        user_data: u64,
    ) -> Posted {
        let param = request_param(user_data, memh.map_or(ptr::null_mut(), MemMap::handle));
        let (api, rkey, len) = (self.api(), self.rkeys[rkey], len as usize);
        // SAFETY: the endpoint is open and `rkey` was unpacked on it (indexing panics
        // otherwise); the caller vouches for both ranges.
        posted(unsafe {
            if write {
                (api.ucp_put_nbx)(self.raw, local.cast_const().cast(), len, remote, rkey, &param)
            } else {
                (api.ucp_get_nbx)(self.raw, local.cast(), len, remote, rkey, &param)
            }
        })
    }

    /// Completes every put posted so far at the peer; reports with `user_data`.
    pub(crate) fn flush(&self, user_data: u64) -> Posted {
        let param = request_param(user_data, ptr::null_mut());
        // SAFETY: the endpoint is open; `param` is valid for the call.
        posted(unsafe { (self.api().ucp_ep_flush_nbx)(self.raw, &param) })
    }

    /// Closes the endpoint; with `force`, without waiting for the peer: every request still
    /// in flight on it completes with an error. Progresses the worker until the close is done
    /// or `timeout` passes (then the endpoint is abandoned to the worker, which destroys it).
    pub(crate) fn close(mut self, force: bool, timeout: Duration) {
        self.close_now(force, timeout);
    }

    fn close_now(&mut self, force: bool, timeout: Duration) {
        if std::mem::replace(&mut self.closed, true) {
            return;
        }
        let api = self.api();
        for rkey in self.rkeys.drain(..) {
            // SAFETY: unpacked on this endpoint, destroyed once, before the endpoint closes.
            unsafe { (api.ucp_rkey_destroy)(rkey) };
        }
        // No callback: the close is polled below.
        let param = sys::RequestParam {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 },
            cb: None,
            user_data: ptr::null_mut(),
            ..request_param(0, ptr::null_mut())
        };
        // SAFETY: the endpoint is open and closed once.
        let request = unsafe { (api.ucp_ep_close_nbx)(self.raw, &param) };
        if posted(request) != Posted::Pending {
            return;
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.worker.progress();
            // SAFETY: `request` is a live request of this worker, not yet freed.
            let status = unsafe { (api.ucp_request_check_status)(request) };
            if status != sys::UCS_INPROGRESS || std::time::Instant::now() >= deadline {
                break;
            }
            self.worker.wait(Duration::from_millis(1));
        }
        // SAFETY: released once; if still in flight UCX finishes it on its own.
        unsafe { (api.ucp_request_free)(request) };
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close_now(true, Duration::from_secs(1));
    }
}

/// Whether a status is `UCS_ERR_CANCELED` (a request purged by a forced close).
pub(crate) fn is_canceled(status: sys::Status) -> bool {
    status == sys::UCS_ERR_CANCELED
}
