//! Offloads through the staged route into an `O_DIRECT` file (device memory -> bounce region
//! -> file): every byte of every object reported `Completed` is in the file, whether the
//! objects cross stage boundaries (one batch, stages side by side) or share sectors with other
//! threads' batches.

mod support;

use std::sync::{Arc, Barrier};

use support::*;
use umbp_composite::{
    offload, CompositeConfig, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject, Staging,
};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    Endpoint, EndpointId, EndpointRegistry, Fragment, ObjectState, Register, Registration, Tag,
    TransferEngine,
};
use umbp_ssd::{SsdConfig, SsdEngine};

/// A composite of [host copies, device, SSD] whose staged route carries device memory to an
/// `O_DIRECT` file.
struct FileRig {
    composite: CompositeEngine,
    hbm: Arc<HbmEngine<SimDevice>>,
    path: std::path::PathBuf,
    file_id: EndpointId,
    /// The file's bytes as written before the test.
    initial: Vec<u8>,
    _file: Registration<std::fs::File>,
    _dir: tempfile::TempDir,
    _bounce: Vec<u8>,
}

/// The rig with a file of `file_len` bytes and stages of `stage_bytes` in a bounce region of
/// `slots` slots; `None` (with the reason printed) where the filesystem refuses `O_DIRECT`.
fn file_rig(file_len: usize, stage_bytes: u64, slots: u64, workers: usize) -> Option<FileRig> {
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
    let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::default()).unwrap());
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("offload.bin");
    let initial = pattern(file_len, 201);
    std::fs::write(&path, &initial).unwrap();
    let file = ssd.register_file(path.as_path(), 0, file_len as u64).unwrap();
    if !ssd.file_info(file.id()).unwrap().direct {
        eprintln!("skipped: the filesystem of {} refuses O_DIRECT", path.display());
        return None;
    }
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd];
    let config = CompositeConfig { workers, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, engines, config);
    let mut bounce = vec![0u8; (slots * stage_bytes) as usize];
    let endpoint = Endpoint::host(bounce.as_mut_ptr() as u64, bounce.len() as u64);
    // SAFETY: the region lives in the rig, whose composite (its first field, so dropped
    // first) waits for every batch before the region goes.
    let bounce_id = unsafe { register(&composite, endpoint) }.unwrap();
    composite.set_staging(Staging::new(bounce_id).with_stage_bytes(stage_bytes)).unwrap();
    Some(FileRig {
        composite,
        hbm,
        path,
        file_id: file.id(),
        initial,
        _file: file,
        _dir: dir,
        _bounce: bounce,
    })
}

#[test]
fn objects_crossing_stage_boundaries_all_land_in_an_o_direct_file() {
    // The offload: 32 objects of 1,000 bytes from device memory to file offsets
    // 100 + 1000 k, in stages of 4 KiB running side by side, 20 rounds.
    const OBJECTS: usize = 32;
    const SIZE: u64 = 1000;
    let Some(rig) = file_rig(40_000, 4096, 16, 8) else { return };
    let len = OBJECTS * SIZE as usize;
    let mut src = vec![0u8; len];
    let host_id = rig_host(&rig, &mut src);
    let dev = device(&rig.hbm, len as u64);
    let pages: Vec<[u64; 1]> = (0..OBJECTS as u64).map(|k| [100 + k * SIZE]).collect();
    let ranges: Vec<[ObjectRange; 1]> =
        (0..OBJECTS as u64).map(|k| [ObjectRange::new(0, SIZE, dev.id, k * SIZE)]).collect();
    let objects: Vec<ObjectTransfer> = (0..OBJECTS)
        .map(|k| {
            ObjectTransfer::new(
                k as u64,
                PagedObject::new(rig.file_id, &pages[k], SIZE, SIZE),
                &ranges[k],
            )
        })
        .collect();
    let mut builder = rig.composite.builder();
    for round in 0..20u8 {
        // This round's bytes into device memory (host -> device, a direct part).
        src.copy_from_slice(&pattern(len, round));
        builder.begin_object(Tag::new(0)).unwrap();
        builder.push(Fragment::new(host_id, 0, dev.id, 0, len as u64, Tag::new(0))).unwrap();
        builder.commit_object().unwrap();
        let report = rig.composite.submit(builder.finish().unwrap()).unwrap().wait();
        assert!(report.objects[0].state == ObjectState::Completed, "{report:?}");

        let report = offload(&mut builder, &objects).unwrap();
        let file = std::fs::read(&rig.path).unwrap();
        let mut lost = Vec::new();
        for (k, o) in report.objects.iter().enumerate() {
            assert_eq!(o.state, ObjectState::Completed, "round {round}: {o:?}");
            let at = 100 + k * SIZE as usize;
            if file[at..at + SIZE as usize] != src[k * SIZE as usize..(k + 1) * SIZE as usize] {
                lost.push(k);
            }
        }
        assert!(
            lost.is_empty(),
            "round {round}: objects {lost:?} reported Completed, not in the file"
        );
        assert_eq!(file[..100], rig.initial[..100], "round {round}: bytes before the objects");
        assert_eq!(file[100 + len..], rig.initial[100 + len..], "round {round}: bytes after them");
    }
}

/// Registers `bytes` (alive for the rest of the test) through the rig's composite.
fn rig_host(rig: &FileRig, bytes: &mut [u8]) -> EndpointId {
    let endpoint = Endpoint::host(bytes.as_mut_ptr() as u64, bytes.len() as u64);
    // SAFETY: every caller keeps `bytes` alive until its transfers were waited on.
    unsafe { register(&rig.composite, endpoint) }.unwrap()
}

#[test]
fn sixteen_threads_offloading_pieces_of_shared_sectors_lose_nothing() {
    // Sixteen threads, each its own batch per round, each writing 30 bytes of the same
    // 512-byte sector of an O_DIRECT file through the staged route, released together: the
    // file's engine must order the read-modify-writes of that sector across batches.
    const THREADS: usize = 16;
    const PIECE: u64 = 30;
    const ROUNDS: usize = 2000;
    const SECTORS: u64 = 8;
    let Some(rig) = file_rig((SECTORS * 4096) as usize, 4096, THREADS as u64, THREADS) else {
        return;
    };
    let dev = device(&rig.hbm, THREADS as u64 * PIECE);
    // Where thread t writes in round r: its 30 bytes of sector r % SECTORS (4 KiB apart).
    let at = |t: usize, r: usize| (r as u64 % SECTORS) * 4096 + 16 + t as u64 * PIECE;
    // The byte thread t writes in round r: never the one it wrote the round before.
    let byte = |t: usize, r: usize| ((r * THREADS + t) % 251 + 1) as u8;
    let start = Barrier::new(THREADS + 1);
    let end = Barrier::new(THREADS + 1);
    let states: Vec<std::sync::Mutex<ObjectState>> =
        (0..THREADS).map(|_| std::sync::Mutex::new(ObjectState::InFlight)).collect();
    let mut lost = 0usize;
    let mut completed = 0usize;
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (rig, dev, start, end, states) = (&rig, &dev, &start, &end, &states);
            s.spawn(move || {
                let mut builder = rig.composite.builder();
                let ranges = [ObjectRange::new(0, PIECE, dev.id, t as u64 * PIECE)];
                for r in 0..ROUNDS {
                    let from = dev.addr + t as u64 * PIECE;
                    rig.hbm.runtime().fill(from, PIECE, byte(t, r)).unwrap();
                    let pages = [at(t, r)];
                    let object = PagedObject::new(rig.file_id, &pages, PIECE, PIECE);
                    let objects = [ObjectTransfer::new(t as u64, object, &ranges)];
                    start.wait();
                    let report = offload(&mut builder, &objects).unwrap();
                    *states[t].lock().unwrap() = report.objects[0].state;
                    end.wait();
                }
            });
        }
        for r in 0..ROUNDS {
            start.wait();
            end.wait();
            let file = std::fs::read(&rig.path).unwrap();
            for (t, state) in states.iter().enumerate() {
                if *state.lock().unwrap() != ObjectState::Completed {
                    continue;
                }
                completed += 1;
                let a = at(t, r) as usize;
                if file[a..a + PIECE as usize].iter().any(|&b| b != byte(t, r)) {
                    lost += 1;
                }
            }
        }
    });
    println!(
        "{completed} of {} objects Completed, {lost} of them not in the file",
        THREADS * ROUNDS
    );
    assert_eq!(lost, 0, "{lost} objects reported Completed whose bytes are not in the file");
    assert_eq!(completed, THREADS * ROUNDS, "every offload completes");
}
