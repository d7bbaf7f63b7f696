//! io_uring and the `pread`/`pwrite` fallback give identical results on the same workload:
//! the same failures (short file, injected errors) with the same tags, the same file bytes and
//! the same destination bytes, with aligned and unaligned pieces, with and without `O_DIRECT`.

mod support;

use std::path::Path;

use support::{HostBuf, Rng, POISON};
use umbp_plan::{EndpointRegistry, Failure, Fragment, Tag};
use umbp_plan::{FileOptions, FileSource, Register};
use umbp_ssd::{Backend, IoFault};

const FILE_LEN: u64 = 8 << 20;
/// The endpoint covers more than the file holds, so reads near its end come up short.
const ENDPOINT_LEN: u64 = FILE_LEN + (1 << 20);

/// Everything a workload leaves behind.
#[derive(Debug, PartialEq, Eq)]
struct Result {
    write_failures: Vec<Failure>,
    read_failures: Vec<Failure>,
    rejected: Vec<Tag>,
    file: Vec<u8>,
    destination: Vec<u8>,
}

fn piece(rng: &mut Rng) -> u64 {
    match rng.below(4) {
        0 => 4096 * (1 + rng.below(32)),
        1 => 1 + rng.below(100),
        _ => 1 + rng.below(50_000),
    }
}

fn workload(dir: &Path, backend: Backend, direct: bool) -> Result {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, backend);
    let path = dir.join(format!("backends_{backend:?}_{direct}.bin"));
    support::write_file(&path, &support::pattern(21, FILE_LEN as usize));
    let file_reg = engine
        .register_file(FileSource::open(&path, FileOptions::new().direct(direct)), 0, ENDPOINT_LEN)
        .unwrap();
    let file = file_reg.id();
    let mut rng = Rng(99);

    // Writes: disjoint file ranges inside the file, from a misaligned source; the write
    // covering byte 1 MiB fails.
    let mut source = HostBuf::new(&registry, 16 << 20, 5, 0);
    source.bytes_mut().copy_from_slice(&support::pattern(22, 16 << 20));
    let mut writes = Vec::new();
    let (mut file_at, mut host_at) = (rng.below(4096), 0);
    let mut tag = 0;
    while file_at < FILE_LEN {
        let len = piece(&mut rng).min(FILE_LEN - file_at);
        if host_at + len > 16 << 20 {
            break;
        }
        writes.push(vec![Fragment::new(source.id, host_at, file, file_at, len, Tag::new(tag))]);
        tag += 1;
        host_at += len;
        file_at += len + rng.below(8192);
    }
    engine.inject_fault(IoFault::write_covering(file, 1 << 20, libc::EIO));
    let written = support::transfer(&engine, &writes);
    engine.clear_faults();

    // Reads: random ranges, some past the end of the file, into disjoint misaligned
    // destinations; the 50th read fails.
    let mut destination = HostBuf::new(&registry, 24 << 20, 3, POISON);
    let mut reads = Vec::new();
    let mut host_at = 0;
    for tag in 0..400 {
        let len = piece(&mut rng);
        let offset = rng.below(ENDPOINT_LEN - len);
        if host_at + len > 24 << 20 {
            break;
        }
        reads.push(vec![Fragment::new(file, offset, destination.id, host_at, len, Tag::new(tag))]);
        host_at += len + rng.below(300);
    }
    engine.inject_fault(IoFault::nth_read(50, libc::EIO));
    let read = support::transfer(&engine, &reads);
    assert!(!read.failures.is_empty() && !written.failures.is_empty());

    let mut rejected = written.rejected;
    rejected.extend(read.rejected);
    let result = Result {
        write_failures: written.failures,
        read_failures: read.failures,
        rejected,
        file: std::fs::read(&path).unwrap(),
        destination: destination.bytes().to_vec(),
    };
    destination.bytes_mut().fill(0);
    result
}

fn compare(dir: &Path, direct: bool) {
    let backends = support::backends("io_uring_and_fallback_give_identical_results");
    if backends.len() < 2 {
        return;
    }
    let ring = workload(dir, Backend::IoUring, direct);
    let blocking = workload(dir, Backend::Blocking, direct);
    assert_eq!(ring.write_failures, blocking.write_failures);
    assert_eq!(ring.read_failures, blocking.read_failures);
    assert_eq!(ring.rejected, blocking.rejected);
    assert!(ring.file == blocking.file, "the files differ (direct: {direct})");
    assert!(ring.destination == blocking.destination, "the destinations differ (direct: {direct})");
}

#[test]
fn io_uring_and_fallback_give_identical_results_buffered() {
    compare(support::temp_dir().path(), false);
}

#[test]
fn io_uring_and_fallback_give_identical_results_o_direct() {
    if let Some(dir) = support::direct_dir("io_uring_and_fallback_give_identical_results_o_direct")
    {
        compare(dir.path(), true);
    }
}
