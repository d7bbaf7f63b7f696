//! The pool in Python: `PoolIndex` (the index itself: embedded or Redis) and `Pool` (keyed
//! blocks in and out of registered memory over an engine and an index). Every call that waits
//! on Redis, redb or a transfer releases the GIL.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use umbp_memory_node::MemoryNodeResolver;
use umbp_pool::{
    BlockError, BlockKey, DropReason, EmbeddedIndex, GetBlock, GetOutcome, Index, NodeAnnouncement,
    NodeId, Placement as RsPlacement, Pool as RsPool, PoolConfig, Published, PutBlock, PutOutcome,
    RedisConfig, RedisIndex, Removed, Reservation as RsReservation, Reserved, TierFile, TierId,
    TierRegion, TierResolver, TierSpec, Verify,
};

use crate::{message, Engine, Registration};

pyo3::create_exception!(
    _native,
    PoolError,
    crate::Error,
    "The pool's index refused or failed a call; `kind` names why (\"tier_full\", \"too_large\", \
     \"unknown_tier\", \"node_not_alive\", \"tier_conflict\", \"lease_expired\", \
     \"invalid_config\", \"unavailable\" for Redis or the store failing, \"corrupt\", ...)."
);

/// The short name of an index error, for `PoolError.kind`.
fn kind(e: &umbp_pool::Error) -> &'static str {
    use umbp_pool::Error as E;
    match e {
        E::UnknownTier { .. } => "unknown_tier",
        E::TierConflict { .. } => "tier_conflict",
        E::TooLarge { .. } => "too_large",
        E::TierFull { .. } => "tier_full",
        E::NodeNotAlive(_) => "node_not_alive",
        E::LeaseExpired(_) => "lease_expired",
        E::InvalidConfig(_) => "invalid_config",
        E::TlsUnavailable => "tls_unavailable",
        E::Redis(_) | E::Store(_) => "unavailable",
        E::Corrupt(_) => "corrupt",
        E::ChecksumMismatch { .. } => "checksum_mismatch",
        E::Transfer(_) => "transfer",
        _ => "other",
    }
}

/// A `PoolError` carrying `e`'s message and kind.
fn pool_error(py: Python<'_>, e: &umbp_pool::Error) -> PyErr {
    let err = PoolError::new_err(message(e));
    let _ = err.value(py).setattr("kind", kind(e));
    err
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    if s.is_nan() || s <= 0.0 {
        return Err(PyValueError::new_err(format!("{what} must be a positive number of seconds")));
    }
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{what}={s}: too long")))
}

fn key_of(b: &[u8]) -> PyResult<BlockKey> {
    BlockKey::from_slice(b)
        .ok_or_else(|| PyValueError::new_err(format!("a block key is 16 bytes, not {}", b.len())))
}

fn keys_of(keys: &[Vec<u8>]) -> PyResult<Vec<BlockKey>> {
    keys.iter().map(|k| key_of(k)).collect()
}

/// Where a published block is: node, tier, slot, length, CRC32C and the slot's generation.
#[pyclass(module = "umbp._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct Placement {
    key: [u8; 16],
    #[pyo3(get)]
    node: u32,
    #[pyo3(get)]
    tier: u16,
    #[pyo3(get)]
    slot: u32,
    #[pyo3(get)]
    length: u64,
    #[pyo3(get)]
    checksum: u32,
    #[pyo3(get)]
    generation: u64,
}

impl From<RsPlacement> for Placement {
    fn from(p: RsPlacement) -> Self {
        Self {
            key: p.key.0,
            node: p.node.0,
            tier: p.tier.0,
            slot: p.slot,
            length: p.len,
            checksum: p.checksum,
            generation: p.generation,
        }
    }
}

impl Placement {
    fn rs(&self) -> RsPlacement {
        RsPlacement {
            key: BlockKey(self.key),
            node: NodeId(self.node),
            tier: TierId(self.tier),
            slot: self.slot,
            len: self.length,
            checksum: self.checksum,
            generation: self.generation,
        }
    }
}

#[pymethods]
impl Placement {
    #[new]
    #[pyo3(signature = (key, node, tier, slot, length, checksum, generation))]
    fn new(
        key: &[u8],
        node: u32,
        tier: u16,
        slot: u32,
        length: u64,
        checksum: u32,
        generation: u64,
    ) -> PyResult<Self> {
        Ok(Self { key: key_of(key)?.0, node, tier, slot, length, checksum, generation })
    }

    /// The block's key, 16 bytes.
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.key)
    }

    fn __repr__(&self) -> String {
        format!(
            "Placement(key={}, node={}, tier={}, slot={}, length={}, checksum={:#010x}, generation={})",
            BlockKey(self.key),
            self.node,
            self.tier,
            self.slot,
            self.length,
            self.checksum,
            self.generation
        )
    }
}

/// A slot reserved for one key: write the block there, then `PoolIndex.publish` (or `abort`).
#[pyclass(module = "umbp._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct Reservation {
    key: [u8; 16],
    #[pyo3(get)]
    node: u32,
    #[pyo3(get)]
    tier: u16,
    #[pyo3(get)]
    slot: u32,
    #[pyo3(get)]
    length: u64,
    #[pyo3(get)]
    generation: u64,
}

impl From<RsReservation> for Reservation {
    fn from(r: RsReservation) -> Self {
        Self {
            key: r.key.0,
            node: r.node.0,
            tier: r.tier.0,
            slot: r.slot,
            length: r.len,
            generation: r.generation,
        }
    }
}

impl Reservation {
    fn rs(&self) -> RsReservation {
        RsReservation {
            key: BlockKey(self.key),
            node: NodeId(self.node),
            tier: TierId(self.tier),
            slot: self.slot,
            len: self.length,
            generation: self.generation,
        }
    }
}

#[pymethods]
impl Reservation {
    /// The key being written, 16 bytes.
    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.key)
    }

    fn __repr__(&self) -> String {
        format!(
            "Reservation(key={}, node={}, tier={}, slot={}, length={}, generation={})",
            BlockKey(self.key),
            self.node,
            self.tier,
            self.slot,
            self.length,
            self.generation
        )
    }
}

/// One answer of `reserve_many`: a reservation, the placement of a key already published,
/// or the `PoolError` of that item alone.
#[derive(IntoPyObject)]
enum ReserveAnswer {
    Slot(Reservation),
    Present(Placement),
    Error(PyObject),
}

/// The index of a pool: embedded (a redb file, one node) or shared (Redis). Thread-safe.
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct PoolIndex {
    index: Arc<dyn Index>,
    /// The same index where it is embedded (what `reconcile` needs), None for Redis.
    embedded: Option<Arc<EmbeddedIndex>>,
    /// What the index is, for `repr`.
    url: String,
}

impl PoolIndex {
    /// Runs `f` on the index with the GIL released; an index error is a `PoolError`.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&dyn Index) -> Result<T, umbp_pool::Error> + Send,
    ) -> PyResult<T> {
        let index = Arc::clone(&self.index);
        py.allow_threads(move || f(&*index)).map_err(|e| pool_error(py, &e))
    }
}

#[pymethods]
impl PoolIndex {
    /// `url`: a path (an embedded index in that redb file, created if missing) or
    /// `redis://[user:password@]host:port/db` (`rediss://` for TLS where the build has it).
    /// `password` and `username` override the URL's; `prefix` names the pool inside the
    /// server; `timeout`: seconds each Redis call may take; `secret`: the cluster's secret
    /// (bytes, the memory nodes' one): Redis entries are sealed under it, so a Redis writer
    /// without it cannot make an entry any client takes for a hit (every client of one pool
    /// must give the same one; an embedded index refuses it: its file has no such writer).
    #[new]
    #[pyo3(signature = (url, *, password=None, username=None, prefix="umbp", timeout=5.0, secret=None))]
    fn new(
        py: Python<'_>,
        url: &str,
        password: Option<String>,
        username: Option<String>,
        prefix: &str,
        timeout: f64,
        secret: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        let timeout = seconds("timeout", timeout)?;
        let mut embedded = None;
        let index: Arc<dyn Index> = if url.starts_with("redis://") || url.starts_with("rediss://") {
            let mut config = RedisConfig::new(url);
            config.password = password;
            config.username = username;
            config.prefix = prefix.to_owned();
            config.timeout = timeout;
            config.secret = secret;
            Arc::new(
                py.allow_threads(|| RedisIndex::connect(&config))
                    .map_err(|e| pool_error(py, &e))?,
            )
        } else {
            if secret.is_some() {
                return Err(PyValueError::new_err(
                    "PoolIndex: a secret seals Redis entries; an embedded index takes none",
                ));
            }
            let path = std::path::PathBuf::from(url);
            let e = Arc::new(
                py.allow_threads(|| EmbeddedIndex::open(path)).map_err(|e| pool_error(py, &e))?,
            );
            embedded = Some(Arc::clone(&e));
            e
        };
        // The URL without its password, for repr.
        let shown = match url.split_once('@') {
            Some((scheme_user, host)) if url.contains("://") => {
                let scheme = scheme_user.split("://").next().unwrap_or("redis");
                format!("{scheme}://***@{host}")
            }
            _ => url.to_owned(),
        };
        Ok(Self { index, embedded, url: shown })
    }

    fn __repr__(&self) -> String {
        format!("PoolIndex({:?})", self.url)
    }

    /// Whether the index is embedded (a redb file of this process) rather than Redis.
    #[getter]
    fn embedded(&self) -> bool {
        self.embedded.is_some()
    }

    /// Makes an embedded index agree with its tier files, after a crash or anything done to
    /// the files while no process held them: call it after opening, before the first lookup.
    /// `tier_files`: `(node, tier, slot_size, slot_count, path, base)` per durable tier whose
    /// bytes are in a file (slot `s` at byte `base + s * slot_size` of `path`), as configured
    /// now; tiers not named are left alone.
    ///
    /// Drops every block of those tiers whose bytes cannot be what was published, without
    /// reading any (`verify="none"`): all of a missing file's, those past a short file's end,
    /// all of a tier whose slot size changed, those past a tier's fewer slots; with
    /// `verify="sample"` it also checks the CRC32C of blocks spread over each tier, up to
    /// `max_bytes` per tier, and a tier where one fails (a replaced or damaged file) is
    /// checked whole; `verify="full"` checks every block. It registers each tier's shape as
    /// given (keeping the watermarks registered where the shape is the same).
    ///
    /// Returns a `ReconcileReport`. Errors: `ValueError` (an unknown `verify`), `PoolError` of
    /// kind `unsupported` for a Redis index (its blocks' files are on other nodes: each load
    /// verifies its block instead), `invalid_config` (a bad shape, or a tier to reshape while
    /// blocks of it are reserved or leased), `unavailable` (the deletions could not be
    /// committed: nothing was dropped).
    #[pyo3(signature = (tier_files, verify="sample", *, max_bytes=67_108_864))]
    fn reconcile(
        &self,
        py: Python<'_>,
        tier_files: Vec<(u32, u16, u64, u32, std::path::PathBuf, u64)>,
        verify: &str,
        max_bytes: u64,
    ) -> PyResult<ReconcileReport> {
        let verify = match verify {
            "none" => Verify::Shape,
            "sample" => Verify::Sample { max_bytes },
            "full" => Verify::Full,
            other => {
                return Err(PyValueError::new_err(format!(
                    "verify must be \"none\", \"sample\" or \"full\", not {other:?}"
                )))
            }
        };
        let Some(index) = self.embedded.clone() else {
            let err = PoolError::new_err(
                "reconcile applies to an embedded index only: a Redis index's blocks are in \
                 other nodes' files, and each load verifies its block",
            );
            let _ = err.value(py).setattr("kind", "unsupported");
            return Err(err);
        };
        let report = py
            .allow_threads(move || {
                let mut files = Vec::with_capacity(tier_files.len());
                for (node, tier, slot_size, slot_count, path, base) in tier_files {
                    let mut spec = spec_of(node, tier, slot_size, slot_count, true, None, None);
                    // The same shape keeps the watermarks it was registered with.
                    if let Some(r) = index.tier_spec(NodeId(node), TierId(tier))? {
                        if (r.slot_size, r.slot_count, r.durable) == (slot_size, slot_count, true) {
                            spec = r;
                        }
                    }
                    files.push(TierFile { spec, path, base });
                }
                index.reconcile(&files, verify)
            })
            .map_err(|e| pool_error(py, &e))?;
        let dropped = report
            .dropped
            .into_iter()
            .map(|d| {
                let (reason, detail) = match d.reason {
                    DropReason::FileMissing { error } => ("file_missing", error),
                    DropReason::PastEnd { file_len } => {
                        ("past_end", format!("the file is {file_len} bytes"))
                    }
                    DropReason::Reshaped => ("reshaped", String::new()),
                    DropReason::Shrunk => ("shrunk", String::new()),
                    DropReason::ChecksumMismatch { actual } => {
                        ("checksum_mismatch", format!("read CRC32C {actual:#010x}"))
                    }
                    DropReason::Unreadable { error } => ("unreadable", error),
                    _ => ("other", String::new()),
                };
                (Placement::from(d.placement), reason, detail)
            })
            .collect();
        Ok(ReconcileReport {
            kept: report.kept,
            verified: report.verified,
            bytes_read: report.bytes_read,
            escalated: report.escalated,
            dropped,
        })
    }

    /// Registers tier `tier` of node `node`: `slot_count` slots of `slot_size` bytes;
    /// `low`/`high`: the eviction watermarks in free slots (default 5 % / 10 %). The same shape
    /// again is a no-op; another is a `PoolError` of kind `tier_conflict`.
    #[pyo3(signature = (node, tier, slot_size, slot_count, *, durable=false, low=None, high=None))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    fn register_tier(
        &self,
        py: Python<'_>,
        node: u32,
        tier: u16,
        slot_size: u64,
        slot_count: u32,
        durable: bool,
        low: Option<u32>,
        high: Option<u32>,
    ) -> PyResult<()> {
        let spec = spec_of(node, tier, slot_size, slot_count, durable, low, high);
        self.call(py, move |i| i.register_tier(&spec))
    }

    /// The shape tier `tier` of node `node` was registered with, as
    /// `(slot_size, slot_count, durable, low, high)`; `None` if never registered.
    fn tier_spec(&self, py: Python<'_>, node: u32, tier: u16) -> PyResult<Option<SpecTuple>> {
        let spec = self.call(py, move |i| i.tier_spec(NodeId(node), TierId(tier)))?;
        Ok(spec.map(|s| (s.slot_size, s.slot_count, s.durable, s.low_watermark, s.high_watermark)))
    }

    /// Reserves slots of tier `tier` of node `node` for `items` (`(key, length)` each) for
    /// `ttl` seconds, in one round trip: per item a `Reservation`, the `Placement` of a key
    /// already published, or the `PoolError` of that item alone (not raised).
    fn reserve_many(
        &self,
        py: Python<'_>,
        node: u32,
        tier: u16,
        items: Vec<(Vec<u8>, u64)>,
        ttl: f64,
    ) -> PyResult<Vec<ReserveAnswer>> {
        let ttl = seconds("ttl", ttl)?;
        let items: Vec<(BlockKey, u64)> =
            items.iter().map(|(k, len)| Ok((key_of(k)?, *len))).collect::<PyResult<_>>()?;
        let answers =
            self.call(py, move |i| i.reserve_many(NodeId(node), TierId(tier), &items, ttl))?;
        Ok(answers
            .into_iter()
            .map(|a| match a {
                Ok(Reserved::Slot(r)) => ReserveAnswer::Slot(r.into()),
                Ok(Reserved::Present(p)) => ReserveAnswer::Present(p.into()),
                Err(e) => ReserveAnswer::Error(pool_error(py, &e).into_value(py).into_any()),
            })
            .collect())
    }

    /// Publishes each `(reservation, crc32c)` in one round trip: per item `("won", placement)`,
    /// `("lost", winner)` (another writer published the key first; this slot was freed) or
    /// `("expired", None)` (nothing published).
    fn publish(
        &self,
        py: Python<'_>,
        items: Vec<(PyRef<'_, Reservation>, u32)>,
    ) -> PyResult<Vec<(&'static str, Option<Placement>)>> {
        let items: Vec<(RsReservation, u32)> = items.iter().map(|(r, c)| (r.rs(), *c)).collect();
        let answers = self.call(py, move |i| i.publish(&items))?;
        Ok(answers
            .into_iter()
            .map(|a| match a {
                Published::Won(p) => ("won", Some(p.into())),
                Published::Lost { winner } => ("lost", Some(winner.into())),
                Published::Expired => ("expired", None),
            })
            .collect())
    }

    /// Frees the slots of reservations that will not be published.
    fn abort(&self, py: Python<'_>, reservations: Vec<PyRef<'_, Reservation>>) -> PyResult<()> {
        let rs: Vec<RsReservation> = reservations.iter().map(|r| r.rs()).collect();
        self.call(py, move |i| i.abort(&rs))
    }

    /// The placement of each key (`None`: not published), in one round trip.
    fn lookup(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<Vec<Option<Placement>>> {
        let keys = keys_of(&keys)?;
        let found = self.call(py, move |i| i.lookup(&keys))?;
        Ok(found.into_iter().map(|p| p.map(Placement::from)).collect())
    }

    /// How many of `keys`, from the first, are published.
    fn prefix_hits(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<usize> {
        let keys = keys_of(&keys)?;
        self.call(py, move |i| i.prefix_hits(&keys))
    }

    /// Takes one lease over `placements` for `ttl` seconds: `(lease_id, granted)`, one flag
    /// per placement (`False`: its slot no longer holds that block, a miss).
    fn lease(
        &self,
        py: Python<'_>,
        placements: Vec<PyRef<'_, Placement>>,
        ttl: f64,
    ) -> PyResult<(u64, Vec<bool>)> {
        let ttl = seconds("ttl", ttl)?;
        let ps: Vec<RsPlacement> = placements.iter().map(|p| p.rs()).collect();
        let lease = self.call(py, move |i| i.lease(&ps, ttl))?;
        Ok((lease.id, lease.granted))
    }

    /// Extends lease `lease_id` to `ttl` seconds from now; a `PoolError` of kind
    /// `lease_expired` if it already ended.
    fn renew(&self, py: Python<'_>, lease_id: u64, ttl: f64) -> PyResult<()> {
        let ttl = seconds("ttl", ttl)?;
        self.call(py, move |i| i.renew(lease_id, ttl))
    }

    /// Ends lease `lease_id` (a no-op if it already ended).
    fn release(&self, py: Python<'_>, lease_id: u64) -> PyResult<()> {
        self.call(py, move |i| i.release(lease_id))
    }

    /// Removes keys: per key `"removed"`, `"absent"` or `"leased"` (a reader holds it).
    fn remove(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<Vec<&'static str>> {
        let keys = keys_of(&keys)?;
        let removed = self.call(py, move |i| i.remove(&keys))?;
        Ok(removed.into_iter().map(removed_name).collect())
    }

    /// Evicts up to `count` unleased blocks of a tier, least recently used first.
    fn evict(&self, py: Python<'_>, node: u32, tier: u16, count: u32) -> PyResult<u32> {
        self.call(py, move |i| i.evict(NodeId(node), TierId(tier), count))
    }

    /// The tier's slots now: `(free, reserved, published)`.
    fn tier_stats(&self, py: Python<'_>, node: u32, tier: u16) -> PyResult<(u32, u32, u32)> {
        let s = self.call(py, move |i| i.tier_stats(NodeId(node), TierId(tier)))?;
        Ok((s.free, s.reserved, s.published))
    }

    /// Announces (or renews) node `node` for `ttl` seconds: its `address` and its tiers'
    /// free bytes (`(tier, free_bytes)` each).
    #[pyo3(signature = (node, address, tiers, ttl))]
    fn announce(
        &self,
        py: Python<'_>,
        node: u32,
        address: String,
        tiers: Vec<(u16, u64)>,
        ttl: f64,
    ) -> PyResult<()> {
        let ttl = seconds("ttl", ttl)?;
        let a = NodeAnnouncement {
            node: NodeId(node),
            address,
            tiers: tiers.into_iter().map(|(t, f)| (TierId(t), f)).collect(),
        };
        self.call(py, move |i| i.announce(&a, ttl))
    }

    /// Withdraws node `node` now, as if its announcement had just expired (a planned stop:
    /// readers miss its blocks at once); returns whether it was alive.
    fn leave(&self, py: Python<'_>, node: u32) -> PyResult<bool> {
        self.call(py, move |i| i.leave(NodeId(node)))
    }

    /// The nodes alive now: `(node, address, [(tier, free_bytes)])` each.
    #[allow(clippy::type_complexity)] // The Python tuple.
    fn nodes(&self, py: Python<'_>) -> PyResult<Vec<(u32, String, Vec<(u16, u64)>)>> {
        let nodes = self.call(py, |i| i.nodes())?;
        Ok(nodes
            .into_iter()
            .map(|a| (a.node.0, a.address, a.tiers.into_iter().map(|(t, f)| (t.0, f)).collect()))
            .collect())
    }
}

/// What `PoolIndex.reconcile` found (`umbp_pool::ReconcileReport`).
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct ReconcileReport {
    /// Blocks of the tiers named still published.
    #[pyo3(get)]
    kept: u64,
    /// Of those, how many were read and matched their CRC32C.
    #[pyo3(get)]
    verified: u64,
    /// Bytes read to verify.
    #[pyo3(get)]
    bytes_read: u64,
    /// Tiers verified whole because a sampled block failed.
    #[pyo3(get)]
    escalated: u32,
    /// Every block taken out: `(placement, reason, detail)`, `reason` one of
    /// `"file_missing"`, `"past_end"`, `"reshaped"`, `"shrunk"`, `"checksum_mismatch"`,
    /// `"unreadable"` (`detail`: the error, the file's length or the CRC32C read, or "").
    #[pyo3(get)]
    dropped: Vec<(Placement, &'static str, String)>,
}

#[pymethods]
impl ReconcileReport {
    fn __repr__(&self) -> String {
        format!(
            "ReconcileReport(kept={}, verified={}, bytes_read={}, escalated={}, dropped={})",
            self.kept,
            self.verified,
            self.bytes_read,
            self.escalated,
            self.dropped.len()
        )
    }
}

fn removed_name(r: Removed) -> &'static str {
    match r {
        Removed::Removed => "removed",
        Removed::Absent => "absent",
        Removed::Leased => "leased",
    }
}

fn spec_of(
    node: u32,
    tier: u16,
    slot_size: u64,
    slot_count: u32,
    durable: bool,
    low: Option<u32>,
    high: Option<u32>,
) -> TierSpec {
    let mut spec = TierSpec::new(NodeId(node), TierId(tier), slot_size, slot_count);
    spec.durable = durable;
    spec.low_watermark = low.unwrap_or(spec.low_watermark);
    spec.high_watermark = high.unwrap_or(spec.high_watermark.max(spec.low_watermark));
    spec
}

/// A tier's shape from Python's side: `(slot_size, slot_count, durable, low, high)`.
type SpecTuple = (u64, u32, bool, u32, u32);

/// One block's outcome from Python's side: `(status, placement, error)`.
type Outcome = (&'static str, Option<Placement>, Option<String>);

fn block_error(e: &BlockError) -> String {
    message(e)
}

/// Keyed blocks in and out of an engine's registered memory, over a `PoolIndex`.
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct Pool {
    /// `None` only while being dropped.
    pool: Mutex<Option<Arc<RsPool>>>,
    engine: Py<Engine>,
    /// The registrations holding the tiers, kept alive with the pool.
    tiers: Mutex<Vec<Py<Registration>>>,
}

impl Pool {
    fn pool(&self) -> PyResult<Arc<RsPool>> {
        self.pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| crate::ClosedError::new_err("the pool is closed"))
    }

    fn endpoint(&self, r: &Registration) -> PyResult<umbp_plan::EndpointId> {
        self.engine.get().endpoint(r)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let pool = self.pool.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        // Stopping the announcer may wait for a Redis call in flight: never with the GIL.
        Python::with_gil(|py| py.allow_threads(move || drop(pool)));
    }
}

#[pymethods]
impl Pool {
    /// A pool of node `node` over `engine` (whose checksum policy must cover the tiers added:
    /// `checksums="all_tiers"` for DRAM tiers) and `index`. Announces the node now and renews
    /// that from a thread every third of `announce_ttl` seconds while the pool lives. A put's
    /// reservations last `reservation_ttl` seconds, a get's lease `lease_ttl` (renewed while
    /// the transfer runs).
    #[new]
    #[pyo3(signature = (engine, index, *, node, address="", reservation_ttl=30.0, lease_ttl=30.0, announce_ttl=10.0))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    fn new(
        py: Python<'_>,
        engine: Py<Engine>,
        index: &PoolIndex,
        node: u32,
        address: &str,
        reservation_ttl: f64,
        lease_ttl: f64,
        announce_ttl: f64,
    ) -> PyResult<Self> {
        let mut config = PoolConfig::new(NodeId(node));
        config.address = address.to_owned();
        config.reservation_ttl = seconds("reservation_ttl", reservation_ttl)?;
        config.lease_ttl = seconds("lease_ttl", lease_ttl)?;
        config.announce_ttl = seconds("announce_ttl", announce_ttl)?;
        let composite = (**engine.get().composite()).clone();
        // An engine with the remote tier reaches memory nodes' tiers through it.
        let resolver: Option<Arc<dyn TierResolver>> = match &engine.get().remote {
            Some(remote) => Some(Arc::new(
                MemoryNodeResolver::new(Arc::clone(remote), composite.clone())
                    .map_err(crate::error)?,
            )),
            None => None,
        };
        let index = Arc::clone(&index.index);
        let pool = py
            .allow_threads(move || RsPool::with_resolver(index, composite, config, resolver))
            .map_err(|e| pool_error(py, &e))?;
        Ok(Self { pool: Mutex::new(Some(Arc::new(pool))), engine, tiers: Mutex::new(Vec::new()) })
    }

    /// This pool's node.
    #[getter]
    fn node(&self) -> PyResult<u32> {
        Ok(self.pool()?.config().node.0)
    }

    /// Adds tier `tier` of this node: `slot_count` slots of `slot_size` bytes at byte `base`
    /// of `registration` (a DRAM arena or an SSD file of the pool's engine), registered with
    /// the index. The pool keeps the registration until it is closed.
    #[pyo3(signature = (tier, registration, slot_size, slot_count, *, base=0, durable=false, low=None, high=None))]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments.
    fn add_tier(
        &self,
        py: Python<'_>,
        tier: u16,
        registration: Py<Registration>,
        slot_size: u64,
        slot_count: u32,
        base: u64,
        durable: bool,
        low: Option<u32>,
        high: Option<u32>,
    ) -> PyResult<()> {
        let pool = self.pool()?;
        let endpoint = self.endpoint(registration.get())?;
        let spec = spec_of(pool.config().node.0, tier, slot_size, slot_count, durable, low, high);
        let region = TierRegion::new(endpoint, base, &spec);
        py.allow_threads(|| pool.add_tier(spec, region)).map_err(|e| pool_error(py, &e))?;
        self.tiers.lock().unwrap_or_else(PoisonError::into_inner).push(registration);
        Ok(())
    }

    /// Stores `blocks` (`(key, registration, offset, length)` each: the block's bytes in
    /// registered memory) in tier `tier` of node `node` (default: this one; another node's
    /// tier is reached through the remote engine), in one reservation, one transfer batch and
    /// one publish: per block `(status, placement, error)` with status `"stored"`,
    /// `"present"` (already in the pool) or `"failed"` (nothing published; `error` says why).
    #[pyo3(signature = (tier, blocks, *, node=None))]
    fn put(
        &self,
        py: Python<'_>,
        tier: u16,
        blocks: Vec<(Vec<u8>, PyRef<'_, Registration>, u64, u64)>,
        node: Option<u32>,
    ) -> PyResult<Vec<Outcome>> {
        let pool = self.pool()?;
        let node = node.map_or(pool.config().node, NodeId);
        let blocks: Vec<PutBlock> = blocks
            .iter()
            .map(|(k, r, offset, len)| {
                r.check_range(*offset, *len)?;
                Ok(PutBlock { key: key_of(k)?, src: self.endpoint(r)?, offset: *offset, len: *len })
            })
            .collect::<PyResult<_>>()?;
        let out = py
            .allow_threads(|| pool.put_on(node, TierId(tier), &blocks))
            .map_err(|e| pool_error(py, &e))?;
        Ok(out
            .into_iter()
            .map(|o| match o {
                PutOutcome::Stored(p) => ("stored", Some(p.into()), None),
                PutOutcome::Present(p) => ("present", Some(p.into()), None),
                PutOutcome::Failed(e) => ("failed", None, Some(block_error(&e))),
            })
            .collect())
    }

    /// Loads `blocks` (`(key, registration, offset, capacity)` each: where the block's bytes
    /// go) in one lookup, one lease and one transfer batch that verifies each block's
    /// checksum: per block `(status, placement, error)` with status `"loaded"` (every byte
    /// there and verified), `"miss"` or `"failed"` (not to be used: `error` says why; a
    /// checksum mismatch removes the key from the pool).
    fn get(
        &self,
        py: Python<'_>,
        blocks: Vec<(Vec<u8>, PyRef<'_, Registration>, u64, u64)>,
    ) -> PyResult<Vec<Outcome>> {
        let pool = self.pool()?;
        let blocks: Vec<GetBlock> = blocks
            .iter()
            .map(|(k, r, offset, capacity)| {
                r.check_range(*offset, *capacity)?;
                Ok(GetBlock {
                    key: key_of(k)?,
                    dst: self.endpoint(r)?,
                    offset: *offset,
                    capacity: *capacity,
                })
            })
            .collect::<PyResult<_>>()?;
        let out = py.allow_threads(|| pool.get(&blocks)).map_err(|e| pool_error(py, &e))?;
        Ok(out
            .into_iter()
            .map(|o| match o {
                GetOutcome::Loaded(p) => ("loaded", Some(p.into()), None),
                GetOutcome::Miss => ("miss", None, None),
                GetOutcome::Failed(e) => ("failed", None, Some(block_error(&e))),
            })
            .collect())
    }

    /// Whether each key is in the pool (one lookup).
    fn exists(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<Vec<bool>> {
        let pool = self.pool()?;
        let keys = keys_of(&keys)?;
        py.allow_threads(|| pool.exists(&keys)).map_err(|e| pool_error(py, &e))
    }

    /// How many of `keys`, from the first, are in the pool.
    fn prefix_hits(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<usize> {
        let pool = self.pool()?;
        let keys = keys_of(&keys)?;
        py.allow_threads(|| pool.prefix_hits(&keys)).map_err(|e| pool_error(py, &e))
    }

    /// Removes keys: per key `"removed"`, `"absent"` or `"leased"`.
    fn remove(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> PyResult<Vec<&'static str>> {
        let pool = self.pool()?;
        let keys = keys_of(&keys)?;
        let removed = py.allow_threads(|| pool.remove(&keys)).map_err(|e| pool_error(py, &e))?;
        Ok(removed.into_iter().map(removed_name).collect())
    }

    /// The counters: hits, misses, stale, checksum_failures, get_failures, stored, present,
    /// put_failures.
    fn metrics(&self) -> PyResult<std::collections::HashMap<&'static str, u64>> {
        use std::sync::atomic::Ordering::Relaxed;
        let pool = self.pool()?;
        let m = pool.metrics();
        Ok([
            ("hits", m.hits.load(Relaxed)),
            ("misses", m.misses.load(Relaxed)),
            ("stale", m.stale.load(Relaxed)),
            ("checksum_failures", m.checksum_failures.load(Relaxed)),
            ("get_failures", m.get_failures.load(Relaxed)),
            ("stored", m.stored.load(Relaxed)),
            ("present", m.present.load(Relaxed)),
            ("put_failures", m.put_failures.load(Relaxed)),
        ]
        .into_iter()
        .collect())
    }

    /// Leaves the pool now (a planned stop): stops renewing the node's announcement and
    /// withdraws it, so readers miss its blocks at once; later puts to its tiers fail. Returns
    /// whether the node was alive.
    fn leave(&self, py: Python<'_>) -> PyResult<bool> {
        let pool = self.pool()?;
        py.allow_threads(|| pool.leave()).map_err(|e| pool_error(py, &e))
    }

    /// Stops renewing the node's announcement and lets go of the tiers' registrations; later
    /// calls raise `ClosedError`. Idempotent.
    fn close(&self, py: Python<'_>) {
        let pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner).take();
        py.allow_threads(move || drop(pool));
        let tiers = std::mem::take(&mut *self.tiers.lock().unwrap_or_else(PoisonError::into_inner));
        drop(tiers);
    }
}

/// Registers the pool's classes in the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PoolIndex>()?;
    m.add_class::<Pool>()?;
    m.add_class::<Placement>()?;
    m.add_class::<Reservation>()?;
    m.add_class::<ReconcileReport>()?;
    m.add("PoolError", py.get_type::<PoolError>())?;
    Ok(())
}
