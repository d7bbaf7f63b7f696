//! End to end through the composite: a block offloaded into a DRAM tier slot the pool reserved,
//! published with the CRC32C the offload reported, looked up, leased, restored with that
//! checksum verified, and compared byte for byte; bytes that no longer match are a load error.

use std::sync::Arc;
use std::time::Duration;

use umbp_composite::{
    offload, restore, ChecksumPolicy, CompositeConfig, CompositeEngine, ObjectError, ObjectRange,
    ObjectTransfer,
};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{BatchState, EndpointRegistry, FailureCause, Register};
use umbp_pool::{
    checksum, BlockKey, EmbeddedIndex, Index, NodeId, Published, Reserved, TierId, TierRegion,
    TierSpec,
};

const SLOT: u64 = 64 << 10;
const SLOTS: u32 = 8;

#[test]
fn offload_publish_lookup_restore_round_trip() {
    let registry = EndpointRegistry::new();
    let copy = Arc::new(LocalCopyEngine::new(registry.clone()));
    // Checksums in every tier, DRAM included: offloads report each block's CRC32C and restores
    // verify the one they are given.
    let config =
        CompositeConfig { checksums: ChecksumPolicy::AllTiers, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, vec![copy], config);
    let dir = tempfile::tempdir().unwrap();
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    let spec = TierSpec::new(NodeId(0), TierId(0), SLOT, SLOTS);
    index.register_tier(&spec).unwrap();

    // The DRAM tier's arena, poisoned, and the block to save (shorter than a slot).
    let arena =
        composite.register_memory(vec![0xeeu8; (SLOT * u64::from(SLOTS)) as usize]).unwrap();
    let tier = TierRegion::new(arena.id(), 0, &spec);
    let len = SLOT - 1000;
    let block: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let src = composite.register_memory(block.clone()).unwrap();
    let key = BlockKey::from_u128(0x1234);

    // Save: reserve, offload into the slot, publish with the checksum the offload reported.
    let Reserved::Slot(r) =
        index.reserve(key, spec.node, spec.tier, len, Duration::from_secs(30)).unwrap()
    else {
        panic!("fresh index")
    };
    let mut page = [0u64; 1];
    let ranges = [ObjectRange::new(0, len, src.id(), 0)];
    let save = [ObjectTransfer::new(7, tier.object(r.slot, len, &mut page), &ranges)];
    let mut builder = composite.builder();
    let report = offload(&mut builder, &save).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    assert_eq!(index.lookup(&[key]).unwrap(), vec![None], "visible before publish");
    let crc = report.objects[0].checksum.expect("the offload reports the CRC32C it wrote");
    assert_eq!(crc, checksum(&block), "the composite's and the pool's checksum are one CRC32C");
    let published = index.publish(&[(r, crc)]).unwrap();
    let [Published::Won(placement)] = published[..] else { panic!("{published:?}") };

    // Load: one batched lookup, a lease, a restore into fresh memory, a verify.
    let found = index.lookup(&[key, BlockKey::from_u128(0x9999)]).unwrap();
    assert_eq!(found, vec![Some(placement), None]);
    let lease = index.lease(&[placement], Duration::from_secs(10)).unwrap();
    assert!(lease.all_granted());
    let dst = composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let mut page = [0u64; 1];
    let ranges = [ObjectRange::new(0, placement.len, dst.id(), 0)];
    let load =
        [ObjectTransfer::new(8, tier.object(placement.slot, placement.len, &mut page), &ranges)
            .with_checksum(placement.checksum)];
    let report = restore(&mut builder, &load).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    index.release(lease.id).unwrap();

    // Bytes in the slot that no longer match the recorded checksum (overwritten behind the
    // index's back): the restore fails that block, a load error, never a hit.
    let other = composite.register_memory(vec![0x55u8; len as usize]).unwrap();
    let mut page = [0u64; 1];
    let ranges = [ObjectRange::new(0, len, other.id(), 0)];
    let clobber = [ObjectTransfer::new(9, tier.object(placement.slot, len, &mut page), &ranges)];
    assert_eq!(offload(&mut builder, &clobber).unwrap().aggregate, BatchState::Completed);
    let bad = composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let mut page = [0u64; 1];
    let ranges = [ObjectRange::new(0, placement.len, bad.id(), 0)];
    let load =
        [ObjectTransfer::new(10, tier.object(placement.slot, placement.len, &mut page), &ranges)
            .with_checksum(placement.checksum)];
    let report = restore(&mut builder, &load).unwrap();
    assert_eq!(report.aggregate, BatchState::Failed, "{report:?}");
    assert!(
        matches!(
            report.objects[0].error,
            Some(ObjectError::Failed { cause: FailureCause::ChecksumMismatch { .. }, .. })
        ),
        "{report:?}"
    );
    // Put the block back for the checks below.
    let mut page = [0u64; 1];
    let ranges = [ObjectRange::new(0, len, src.id(), 0)];
    let again = [ObjectTransfer::new(11, tier.object(placement.slot, len, &mut page), &ranges)];
    assert_eq!(offload(&mut builder, &again).unwrap().aggregate, BatchState::Completed);

    let out = dst.deregister();
    placement.verify(&out[..len as usize]).unwrap();
    assert_eq!(&out[..len as usize], &block[..]);
    assert!(out[len as usize..].iter().all(|&b| b == 0), "bytes past the block were written");
    // The arena holds the block in exactly its slot, poison elsewhere.
    let arena = arena.deregister();
    let at = tier.slot_offset(placement.slot) as usize;
    assert_eq!(&arena[at..at + len as usize], &block[..]);
    assert!(arena[..at].iter().chain(&arena[at + len as usize..]).all(|&b| b == 0xee));
    drop(src);
}
