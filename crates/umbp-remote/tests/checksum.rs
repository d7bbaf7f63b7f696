//! Block checksums on loads from another node's memory: the composite's default policy
//! verifies remote tiers, on the staged route into the device and the direct one into host
//! memory, and a block whose bytes are not the expected ones fails alone.

mod support;

use std::sync::Arc;

use umbp_composite::{
    restore, CompositeEngine, ObjectError, ObjectRange, ObjectTransfer, PagedObject, Staging,
};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    DeviceOrdinal, EndpointRegistry, FailureCause, ObjectState, Register, TransferEngine,
};
use umbp_remote::RemoteEngine;

use support::{fill_byte, ucx_or_skip, Served};

const PAGE: u64 = 16 << 10;

#[test]
fn remote_loads_are_verified_and_a_wrong_block_fails_alone() {
    if !ucx_or_skip() {
        return;
    }
    let pages = 64usize;
    let server = Served::start("tcp", pages * PAGE as usize, 9);
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let hbm = Arc::new(HbmEngine::new(
        Arc::new(SimDevice::new(1)),
        registry.clone(),
        HbmConfig::default(),
    ));
    let ucx = Arc::new(RemoteEngine::new(registry.clone(), support::config("tcp")).unwrap());
    let peer = ucx.connect(server.addr).unwrap();
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ucx];
    let composite = CompositeEngine::new(registry, engines);
    let arena = &peer.regions[0];
    let remote = composite.register_remote(arena.region, 0, arena.len).unwrap();
    let bounce = composite.register_memory(vec![0u8; 256 << 10]).unwrap();
    composite.set_staging(Staging::new(bounce.id()).with_stage_bytes(24 << 10)).unwrap();
    let dev = hbm.alloc_device(DeviceOrdinal::new(0), 4 * 3 * PAGE).unwrap();
    let out = composite.register_memory(vec![0u8; (4 * 3 * PAGE) as usize]).unwrap();

    let size = 3 * PAGE;
    let tables: Vec<Vec<u64>> =
        (0..4u64).map(|o| (0..3).map(|k| ((o * 3 + k) * 5 % 64) * PAGE).collect()).collect();
    let crc = |table: &[u64]| {
        let bytes: Vec<u8> = (0..size)
            .map(|b| fill_byte(9, (table[(b / PAGE) as usize] + b % PAGE) as usize))
            .collect();
        crc32c::crc32c(&bytes)
    };
    // Objects 0 and 1 into the device (staged), 2 and 3 into host memory (direct); object 1
    // and object 3 are given a checksum their bytes do not have.
    let ranges: Vec<[ObjectRange; 2]> = (0..4u64)
        .map(|o| {
            let dst = if o < 2 { dev.id() } else { out.id() };
            [
                ObjectRange::new(0, 5000, dst, o * size),
                ObjectRange::new(5000, size - 5000, dst, o * size + 5000).in_group(1),
            ]
        })
        .collect();
    let objects: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            let object = PagedObject::new(remote.id(), &tables[o], PAGE, size);
            let wrong = u32::from(o % 2 == 1);
            ObjectTransfer::new(o as u64, object, &ranges[o]).with_checksum(crc(&tables[o]) ^ wrong)
        })
        .collect();
    let report = restore(&mut composite.builder(), &objects).unwrap();
    for (o, r) in report.objects.iter().enumerate() {
        if o % 2 == 0 {
            assert_eq!(r.state, ObjectState::Completed, "{r:?}");
            assert_eq!(r.checksum, Some(crc(&tables[o])));
        } else {
            assert!(
                matches!(
                    r.error,
                    Some(ObjectError::Failed { cause: FailureCause::ChecksumMismatch { .. }, .. })
                ),
                "{r:?}"
            );
        }
    }
    assert_eq!(composite.metrics().checksum_mismatches(), 2);
    assert!(composite.metrics_text().contains("umbp_checksum_mismatches_total{tier=\"remote\"} 2"));
}
