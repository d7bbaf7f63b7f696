//! A [`Pool`](umbp_pool::Pool) over any index with one DRAM tier, putting and getting blocks
//! whose bytes say which block they are, so every get is checked byte for byte: the fault and
//! cluster tests' workload.

use std::sync::Arc;
use std::time::Duration;

use umbp_pool::{Error, Index, NodeId, TierId, TierSpec};

use super::faults::block_bytes;
use super::suite::key;

/// A [`Pool`](umbp_pool::Pool) with one DRAM tier (a fresh, zeroed arena) of 64 slots of 4 KiB,
/// saving and loading blocks of [`DRAM_LEN`] bytes (writer 0's bytes of each id).
pub struct DramPool {
    pub pool: umbp_pool::Pool,
    pub composite: umbp_composite::CompositeEngine,
    pub spec: TierSpec,
    _arena: umbp_plan::Registration<Vec<u8>>,
}

pub const DRAM_LEN: u64 = 3000;

impl DramPool {
    pub fn new(index: Arc<dyn Index>, node: NodeId, announce_ttl: Duration) -> Self {
        Self::with_tier(
            index,
            node,
            announce_ttl,
            TierSpec::new(node, TierId(0), 4096, 64).watermarks(0, 0),
        )
    }

    /// The same with the tier `spec` (of 4 KiB slots, on `node`).
    pub fn with_tier(
        index: Arc<dyn Index>,
        node: NodeId,
        announce_ttl: Duration,
        spec: TierSpec,
    ) -> Self {
        use umbp_composite::{ChecksumPolicy, CompositeConfig, CompositeEngine};
        use umbp_plan::{EndpointRegistry, Register};
        let registry = EndpointRegistry::new();
        let copy = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
        let config =
            CompositeConfig { checksums: ChecksumPolicy::AllTiers, ..CompositeConfig::default() };
        let composite = CompositeEngine::with_config(registry, vec![copy], config);
        let arena = composite.register_memory(vec![0u8; 4096 * spec.slot_count as usize]).unwrap();
        let mut pool_config = umbp_pool::PoolConfig::new(node);
        pool_config.announce_ttl = announce_ttl;
        let pool = umbp_pool::Pool::new(index, composite.clone(), pool_config).unwrap();
        pool.add_tier(spec, umbp_pool::TierRegion::new(arena.id(), 0, &spec)).unwrap();
        Self { pool, composite, spec, _arena: arena }
    }

    /// Puts blocks `from..to`: how many are in the pool after, or the call's error.
    pub fn put(&self, from: u64, to: u64) -> Result<usize, Error> {
        Ok(self.put_outcomes(from, to)?.iter().filter(|o| o.is_in_pool()).count())
    }

    /// Puts blocks `from..to`: one outcome per block, or the call's error.
    pub fn put_outcomes(&self, from: u64, to: u64) -> Result<Vec<umbp_pool::PutOutcome>, Error> {
        use umbp_plan::Register;
        let bytes: Vec<u8> = (from..to).flat_map(|id| block_bytes(id, 0, DRAM_LEN)).collect();
        let src = self.composite.register_memory(bytes).unwrap();
        let blocks: Vec<umbp_pool::PutBlock> = (from..to)
            .map(|id| umbp_pool::PutBlock {
                key: key(id),
                src: src.id(),
                offset: (id - from) * DRAM_LEN,
                len: DRAM_LEN,
            })
            .collect();
        self.pool.put(self.spec.tier, &blocks)
    }

    /// Gets blocks `from..to`: one letter per block, `L` loaded with the right bytes, `X`
    /// loaded with wrong ones, `M` miss, `F` failed; or the call's error.
    pub fn get(&self, from: u64, to: u64) -> Result<String, Error> {
        use umbp_plan::Register;
        use umbp_pool::GetOutcome;
        let n = to - from;
        let dst = self.composite.register_memory(vec![0u8; (n * DRAM_LEN) as usize]).unwrap();
        let blocks: Vec<umbp_pool::GetBlock> = (from..to)
            .map(|id| umbp_pool::GetBlock {
                key: key(id),
                dst: dst.id(),
                offset: (id - from) * DRAM_LEN,
                capacity: DRAM_LEN,
            })
            .collect();
        let out = self.pool.get(&blocks)?;
        let bytes = dst.deregister();
        Ok(out
            .iter()
            .zip(from..)
            .map(|(o, id)| match o {
                GetOutcome::Loaded(_) => {
                    let at = ((id - from) * DRAM_LEN) as usize;
                    if bytes[at..at + DRAM_LEN as usize] == block_bytes(id, 0, DRAM_LEN)[..] {
                        'L'
                    } else {
                        'X'
                    }
                }
                GetOutcome::Miss => 'M',
                GetOutcome::Failed(_) => 'F',
            })
            .collect())
    }
}
