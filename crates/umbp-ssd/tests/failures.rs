//! Failures cost exactly their objects: a file shorter than the requested range, writes into a
//! read-only file, injected I/O errors on chosen reads and writes, endpoints deregistered
//! between planning and submit. Every other object completes, and the poisoned destinations of
//! failed objects stay untouched. Each case runs on io_uring and on the fallback.

mod support;

use std::io::Write;
use std::path::Path;

use support::{HostBuf, POISON};
use umbp_plan::{EndpointId, EndpointRegistry, FailureCause, Fragment, Tag, TransferEngine};
use umbp_plan::{FileOptions, FileSource, Register};
use umbp_ssd::{Backend, IoFault, SsdEngine};

const PAGE: u64 = 64 << 10;

/// One object per page: object `i` reads file page `i` into destination page `i`.
fn page_reads(file: EndpointId, dst: EndpointId, pages: u64) -> Vec<Vec<Fragment>> {
    // Destination pages are spaced out so that no two objects merge into one segment.
    (0..pages)
        .map(|i| vec![Fragment::new(file, i * PAGE, dst, 2 * i * PAGE, PAGE, Tag::new(i as u32))])
        .collect()
}

/// Checks that exactly `failed` objects failed, that every other object's destination page
/// holds file page `i`, and that failed objects' pages (and all gaps) are still poison.
fn check_pages(destination: &HostBuf, file_bytes: &[u8], pages: u64, failed: &[u32]) {
    for i in 0..pages {
        let got = &destination.bytes()[(2 * i * PAGE) as usize..((2 * i + 1) * PAGE) as usize];
        let gap =
            &destination.bytes()[((2 * i + 1) * PAGE) as usize..((2 * i + 2) * PAGE) as usize];
        assert!(gap.iter().all(|&b| b == POISON), "a gap was written");
        if failed.contains(&(i as u32)) {
            assert!(got.iter().all(|&b| b == POISON), "failed object {i} was written");
        } else {
            let want = &file_bytes[(i * PAGE) as usize..((i + 1) * PAGE) as usize];
            assert!(got == want, "object {i} differs");
        }
    }
}

fn tags(list: &[u32]) -> Vec<Tag> {
    list.iter().map(|&t| Tag::new(t)).collect()
}

fn short_file(dir: &Path, backend: Backend, direct: bool) {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, backend);
    let path = dir.join(format!("short_{backend:?}_{direct}.bin"));
    // 7.5 pages on disk, 10 pages registered.
    let file_bytes = support::pattern(11, (7 * PAGE + PAGE / 2) as usize);
    support::write_file(&path, &file_bytes);
    let file_reg = engine
        .register_file(FileSource::open(&path, FileOptions::new().direct(direct)), 0, 10 * PAGE)
        .unwrap();
    let file = file_reg.id();
    let destination = HostBuf::new(&registry, (20 * PAGE) as usize, 0, POISON);
    let outcome = support::transfer(&engine, &page_reads(file, destination.id, 10));
    assert!(outcome.rejected.is_empty());
    assert_eq!(outcome.failed_tags(), tags(&[7, 8, 9]), "{outcome:?}");
    for failure in &outcome.failures {
        assert_eq!(failure.tags.len(), 1, "one failure per failed segment: {failure:?}");
        let FailureCause::ShortFile { offset, expected, got } = failure.cause else {
            panic!("expected a short-file failure, got {failure:?}");
        };
        assert_eq!(expected, PAGE);
        assert_eq!(got, (7 * PAGE + PAGE / 2).saturating_sub(offset));
    }
    check_pages(&destination, &file_bytes, 7, &[]);
    // Object 7 (half of it on disk) and the objects past the end stay poison.
    assert!(destination.bytes()[(14 * PAGE) as usize..].iter().all(|&b| b == POISON));
}

#[test]
fn a_short_file_fails_only_the_objects_past_its_end() {
    let name = "a_short_file_fails_only_the_objects_past_its_end";
    support::each_backend_and_mode(name, |backend, direct, dir| short_file(dir, backend, direct));
}

#[test]
fn writes_into_a_read_only_file_fail_with_ebadf_and_reads_still_work() {
    let dir = support::temp_dir();
    for backend in support::backends("writes_into_a_read_only_file_fail") {
        let registry = EndpointRegistry::new();
        let engine = support::engine(&registry, backend);
        let path = dir.path().join(format!("read_only_{backend:?}.bin"));
        let file_bytes = support::pattern(3, (4 * PAGE) as usize);
        support::write_file(&path, &file_bytes);

        // Opened read-only by the engine, and registered from a read-only descriptor.
        let owned_reg = engine
            .register_file(FileSource::open(&path, FileOptions::new().writable(false)), 0, 4 * PAGE)
            .unwrap();
        let owned = owned_reg.id();
        let opened_reg =
            engine.register_file(std::fs::File::open(&path).unwrap(), 0, 4 * PAGE).unwrap();
        let borrowed = opened_reg.id();
        assert_eq!(engine.file_info(borrowed).map(|i| i.writable), Some(false));
        assert_eq!(engine.file_info(owned).map(|i| i.writable), Some(false));

        let source = HostBuf::new(&registry, (4 * PAGE) as usize, 0, 0x11);
        let writes = vec![
            vec![Fragment::new(source.id, 0, owned, 0, PAGE, Tag::new(0))],
            vec![Fragment::new(source.id, PAGE, borrowed, 2 * PAGE, PAGE, Tag::new(1))],
        ];
        let outcome = support::transfer(&engine, &writes);
        assert_eq!(outcome.failed_tags(), tags(&[0, 1]));
        for failure in &outcome.failures {
            assert_eq!(failure.cause, FailureCause::Io { errno: libc::EBADF }, "{failure:?}");
        }
        assert_eq!(std::fs::read(&path).unwrap(), file_bytes, "the read-only file changed");

        let destination = HostBuf::new(&registry, (8 * PAGE) as usize, 0, POISON);
        let outcome = support::transfer(&engine, &page_reads(borrowed, destination.id, 4));
        assert!(outcome.failed_tags().is_empty(), "{outcome:?}");
        check_pages(&destination, &file_bytes, 4, &[]);
    }
    // Opening a file without write permission for writing is a typed open error (root may
    // write anyway, so this part needs an unprivileged user).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let path = dir.path().join("no_write_permission.bin");
        support::write_file(&path, &[0; 4096]);
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o444))
            .unwrap();
        let engine = support::engine(&EndpointRegistry::new(), Backend::Blocking);
        let error = engine.register_file(path.as_path(), 0, 4096).unwrap_err();
        assert!(matches!(error, umbp_plan::RegisterError::Open { .. }), "{error:?}");
    } else {
        eprintln!("note: running as root, so opening a 0444 file for writing succeeds; skipped");
    }
}

fn injected(dir: &Path, backend: Backend, direct: bool) {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, backend);
    let path = dir.join(format!("injected_{backend:?}_{direct}.bin"));
    let file_bytes = support::pattern(5, (32 * PAGE) as usize);
    support::write_file(&path, &file_bytes);
    let file_reg = engine
        .register_file(FileSource::open(&path, FileOptions::new().direct(direct)), 0, 32 * PAGE)
        .unwrap();
    let file = file_reg.id();

    // Every read covering byte 100 of page 17 fails with EIO.
    engine.inject_fault(IoFault::read_covering(file, 17 * PAGE + 100, libc::EIO));
    // The fifth read the engine starts (object 4: ops start in plan order) fails with ENODATA.
    engine.inject_fault(IoFault::nth_read(5, libc::ENODATA));
    let destination = HostBuf::new(&registry, (64 * PAGE) as usize, 0, POISON);
    let outcome = support::transfer(&engine, &page_reads(file, destination.id, 32));
    assert!(outcome.rejected.is_empty());
    assert_eq!(outcome.failed_tags(), tags(&[4, 17]), "{outcome:?}");
    for failure in &outcome.failures {
        let want = match failure.tags[..] {
            [t] if t == Tag::new(17) => libc::EIO,
            _ => libc::ENODATA,
        };
        assert_eq!(failure.cause, FailureCause::Io { errno: want });
        assert_eq!((failure.src, failure.dst), (file, destination.id));
        assert_eq!(failure.engine, engine.name());
    }
    check_pages(&destination, &file_bytes, 32, &[4, 17]);

    // Writes: the write covering page 3 fails, its file bytes stay as they were.
    engine.clear_faults();
    engine.inject_fault(IoFault::write_covering(file, 3 * PAGE, libc::ENOSPC));
    let source = HostBuf::new(&registry, (8 * PAGE) as usize, 0, 0x5A);
    let writes: Vec<Vec<Fragment>> = (0..4)
        .map(|i| {
            vec![Fragment::new(source.id, 2 * i * PAGE, file, i * PAGE, PAGE, Tag::new(i as u32))]
        })
        .collect();
    let outcome = support::transfer(&engine, &writes);
    assert_eq!(outcome.failed_tags(), tags(&[3]));
    assert_eq!(outcome.failures[0].cause, FailureCause::Io { errno: libc::ENOSPC });
    let on_disk = std::fs::read(&path).unwrap();
    assert!(on_disk[..(3 * PAGE) as usize].iter().all(|&b| b == 0x5A));
    assert!(on_disk[(3 * PAGE) as usize..] == file_bytes[(3 * PAGE) as usize..]);
}

#[test]
fn injected_errors_fail_only_their_objects() {
    let name = "injected_errors_fail_only_their_objects";
    support::each_backend_and_mode(name, |backend, direct, dir| injected(dir, backend, direct));
}

#[test]
fn a_deregistered_endpoint_fails_its_plan_and_the_others_complete() {
    let dir = support::temp_dir();
    for backend in support::backends("a_deregistered_endpoint_fails_its_plan") {
        let registry = EndpointRegistry::new();
        let engine: SsdEngine = support::engine(&registry, backend);
        let file_bytes = support::pattern(9, (4 * PAGE) as usize);
        let mut files = Vec::new();
        for k in 0..3 {
            let path = dir.path().join(format!("gone_{backend:?}_{k}.bin"));
            support::write_file(&path, &file_bytes);
            files.push(engine.register_file(path.as_path(), 0, 4 * PAGE).unwrap());
        }
        let destination = HostBuf::new(&registry, (6 * PAGE) as usize, 0, POISON);
        let spare = HostBuf::new(&registry, PAGE as usize, 0, POISON);
        // Objects 0 and 1 read from files 0 and 1; object 2 reads file 2 into `spare`.
        let mut builder = engine.builder();
        for (k, file) in files.iter().enumerate() {
            let file = file.id();
            let tag = Tag::new(k as u32);
            let dst = if k == 2 { spare.id } else { destination.id };
            builder.begin_object(tag).unwrap();
            builder
                .push(Fragment::new(
                    file,
                    PAGE,
                    dst,
                    if k == 2 { 0 } else { 3 * k as u64 * PAGE },
                    PAGE,
                    tag,
                ))
                .unwrap();
            builder.commit_object().unwrap();
        }
        let plans = builder.finish().unwrap();
        drop(builder);
        assert_eq!(plans.plans().len(), 3);
        let gone = files[1].id();
        drop(files.remove(1));
        registry.deregister(spare.id).unwrap();
        let failures = engine.submit(plans).into_settled().failures;
        assert_eq!(failures.len(), 2, "{failures:?}");
        assert_eq!(failures[0].tags, tags(&[1]));
        assert_eq!(failures[0].cause, FailureCause::EndpointGone(gone));
        assert_eq!(failures[1].tags, tags(&[2]));
        assert_eq!(failures[1].cause, FailureCause::EndpointGone(spare.id));
        assert!(
            destination.bytes()[..PAGE as usize] == file_bytes[PAGE as usize..(2 * PAGE) as usize]
        );
        assert!(destination.bytes()[PAGE as usize..].iter().all(|&b| b == POISON));
        assert!(spare.bytes().iter().all(|&b| b == POISON));
        // The engine no longer knows the deregistered file; a new batch fails at planning.
        assert!(engine.file_info(gone).is_none());
        let outcome = support::transfer(
            &engine,
            &[vec![Fragment::new(gone, 0, destination.id, 0, PAGE, Tag::new(0))]],
        );
        assert_eq!(outcome.rejected, tags(&[0]));
    }
}

#[test]
fn pairs_other_than_file_and_host_are_rejected() {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, Backend::Blocking);
    let a = HostBuf::new(&registry, 4096, 0, 1);
    let b = HostBuf::new(&registry, 4096, 0, POISON);
    let outcome =
        support::transfer(&engine, &[vec![Fragment::new(a.id, 0, b.id, 0, 4096, Tag::new(0))]]);
    assert_eq!(outcome.rejected, tags(&[0]));
    assert!(outcome.failures.is_empty());
    assert!(b.bytes().iter().all(|&x| x == POISON));
}

/// Objects `0 .. pages` read consecutive file pages into consecutive destination pages, so the
/// builder merges all of them into one segment (segments of up to 1 MiB: 16 pages).
fn merged_reads(file: EndpointId, dst: EndpointId, pages: u64) -> Vec<Vec<Fragment>> {
    (0..pages)
        .map(|i| vec![Fragment::new(file, i * PAGE, dst, i * PAGE, PAGE, Tag::new(i as u32))])
        .collect()
}

fn failure_inside_a_merged_segment(dir: &Path, backend: Backend, direct: bool) {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, backend);
    let path = dir.join(format!("merged_{backend:?}_{direct}.bin"));
    let file_bytes = support::pattern(21, (8 * PAGE) as usize);
    support::write_file(&path, &file_bytes);
    let file_reg = engine
        .register_file(FileSource::open(&path, FileOptions::new().direct(direct)), 0, 8 * PAGE)
        .unwrap();
    let file = file_reg.id();

    // An EIO on object 2's bytes, in a segment that carries objects 0 to 3.
    engine.inject_fault(IoFault::read_covering(file, 2 * PAGE + 4096, libc::EIO));
    let destination = HostBuf::new(&registry, (4 * PAGE) as usize, 0, POISON);
    let outcome = support::transfer(&engine, &merged_reads(file, destination.id, 4));
    assert_eq!(outcome.failed_tags(), tags(&[2]), "{outcome:?}");
    assert_eq!(outcome.failures[0].cause, FailureCause::Io { errno: libc::EIO });
    for i in [0u64, 1, 3] {
        let at = (i * PAGE) as usize..((i + 1) * PAGE) as usize;
        assert!(destination.bytes()[at.clone()] == file_bytes[at], "object {i}");
    }
    let failed = (2 * PAGE) as usize..(3 * PAGE) as usize;
    assert!(destination.bytes()[failed].iter().all(|&b| b == POISON), "failed object written");
    engine.clear_faults();

    // The file ends inside object 5 of a segment carrying objects 4 to 7, seen at submit: only
    // the objects whose bytes lie past the end fail.
    let short = dir.join(format!("merged_short_{backend:?}_{direct}.bin"));
    support::write_file(&short, &file_bytes[..(5 * PAGE + PAGE / 2) as usize]);
    let file_reg = engine
        .register_file(FileSource::open(&short, FileOptions::new().direct(direct)), 0, 8 * PAGE)
        .unwrap();
    let file = file_reg.id();
    let destination = HostBuf::new(&registry, (8 * PAGE) as usize, 0, POISON);
    let reads: Vec<Vec<Fragment>> = merged_reads(file, destination.id, 8)[4..].to_vec();
    let outcome = support::transfer(&engine, &reads);
    assert_eq!(outcome.failed_tags(), tags(&[5, 6, 7]), "{outcome:?}");
    assert!(outcome.failures.iter().all(|f| matches!(f.cause, FailureCause::ShortFile { .. })));
    let at = (4 * PAGE) as usize..(5 * PAGE) as usize;
    assert!(destination.bytes()[at.clone()] == file_bytes[at], "object 4");
}

#[test]
fn a_failure_inside_a_merged_segment_fails_only_the_objects_whose_bytes_failed() {
    let name = "a_failure_inside_a_merged_segment";
    support::each_backend_and_mode(name, |backend, direct, dir| {
        failure_inside_a_merged_segment(dir, backend, direct)
    });
}

#[test]
fn deregistering_a_file_right_after_submit_does_not_fail_the_submitted_batch() {
    let dir = support::temp_dir();
    for backend in support::backends("deregistering_a_file_right_after_submit") {
        let registry = EndpointRegistry::new();
        let engine = support::engine(&registry, backend);
        let path = dir.path().join(format!("pinned_{backend:?}.bin"));
        let file_bytes = support::pattern(13, (16 * PAGE) as usize);
        support::write_file(&path, &file_bytes);
        let file_reg = engine
            .register_file(FileSource::open(&path, FileOptions::new()), 0, 16 * PAGE)
            .unwrap();
        let file = file_reg.id();
        let destination = HostBuf::new(&registry, (32 * PAGE) as usize, 0, POISON);
        let mut builder = engine.builder();
        for (i, object) in page_reads(file, destination.id, 16).iter().enumerate() {
            builder.begin_object(Tag::new(i as u32)).unwrap();
            builder.push(object[0]).unwrap();
            builder.commit_object().unwrap();
        }
        let plans = builder.finish().unwrap();
        drop(builder);
        let mut handle = engine.submit(plans);
        // The registration closes the file once no batch uses it: this one still does, so
        // ending it waits for the batch; so does the host memory's deregistration.
        drop(file_reg);
        registry.deregister(destination.id).unwrap();
        // Every byte landed before the deregistrations returned.
        check_pages(&destination, &file_bytes, 16, &[]);
        assert!(handle.wait().is_empty(), "{:?}", handle.wait());
        // Later batches see them gone.
        let outcome = support::transfer(
            &engine,
            &[vec![Fragment::new(file, 0, destination.id, 0, PAGE, Tag::new(0))]],
        );
        assert_eq!(outcome.rejected, tags(&[0]));
    }
}

#[test]
fn reads_that_land_on_the_same_memory_fail_with_overlap_and_write_nothing() {
    let dir = support::temp_dir();
    for backend in support::backends("reads_that_land_on_the_same_memory") {
        let registry = EndpointRegistry::new();
        let engine = support::engine(&registry, backend);
        let path = dir.path().join(format!("overlap_{backend:?}.bin"));
        let file_bytes = support::pattern(17, (4 * PAGE) as usize);
        support::write_file(&path, &file_bytes);
        let file_reg =
            engine.register_file(FileSource::open(&path, FileOptions::new()), 0, 4 * PAGE).unwrap();
        let file = file_reg.id();
        let destination = HostBuf::new(&registry, (4 * PAGE) as usize, 0, POISON);
        // Objects 0 and 1 both write destination bytes PAGE/2 .. PAGE; object 2 is alone.
        let objects = vec![
            vec![Fragment::new(file, 0, destination.id, 0, PAGE, Tag::new(0))],
            vec![Fragment::new(file, PAGE, destination.id, PAGE / 2, PAGE, Tag::new(1))],
            vec![Fragment::new(file, 2 * PAGE, destination.id, 3 * PAGE, PAGE, Tag::new(2))],
        ];
        let outcome = support::transfer(&engine, &objects);
        assert_eq!(outcome.failed_tags(), tags(&[0, 1]), "{outcome:?}");
        assert!(outcome.failures.iter().all(|f| f.cause == FailureCause::Overlap));
        let bytes = destination.bytes();
        assert!(bytes[..(3 * PAGE) as usize].iter().all(|&b| b == POISON));
        assert!(
            bytes[(3 * PAGE) as usize..] == file_bytes[(2 * PAGE) as usize..(3 * PAGE) as usize]
        );
    }
}

#[test]
fn a_read_that_never_completes_ends_at_the_deadline_and_only_its_object_fails() {
    let dir = support::temp_dir();
    for backend in support::backends("a_read_that_never_completes") {
        let registry = EndpointRegistry::new();
        let engine = support::engine(&registry, backend);
        // A FIFO nobody writes to: a read of it waits forever.
        let fifo = dir.path().join(format!("never_{backend:?}.fifo"));
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
        // Opened for reading and writing, which does not wait for a writer.
        let stuck_reg = engine
            .register_file(FileSource::open(&fifo, FileOptions::new().direct(false)), 0, 1 << 20)
            .unwrap();
        let stuck = stuck_reg.id();
        let path = dir.path().join(format!("fine_{backend:?}.bin"));
        let file_bytes = support::pattern(23, PAGE as usize);
        support::write_file(&path, &file_bytes);
        let fine_reg =
            engine.register_file(FileSource::open(&path, FileOptions::new()), 0, PAGE).unwrap();
        let fine = fine_reg.id();
        let destination = HostBuf::new(&registry, (2 * PAGE) as usize, 0, POISON);

        let mut builder = engine.builder();
        for (tag, file, at) in [(0u32, stuck, 0), (1, fine, PAGE)] {
            builder.begin_object(Tag::new(tag)).unwrap();
            builder.push(Fragment::new(file, 0, destination.id, at, 4096, Tag::new(tag))).unwrap();
            builder.commit_object().unwrap();
        }
        let mut plans = builder.finish().unwrap();
        drop(builder);
        let start = std::time::Instant::now();
        plans.set_deadline(Some(start + std::time::Duration::from_millis(200)));
        let failures = engine.submit(plans).into_settled().failures;
        let took = start.elapsed();
        assert!(took < std::time::Duration::from_secs(2), "{backend:?}: took {took:?}");
        assert_eq!(failures.len(), 1, "{backend:?}: {failures:?}");
        assert_eq!(failures[0].tags, tags(&[0]));
        match backend {
            // The ring issues the read and cancels it at the deadline.
            Backend::IoUring => assert_eq!(failures[0].cause, FailureCause::TimedOut),
            // `pread` refuses a FIFO at once (it cannot seek).
            _ => assert!(matches!(failures[0].cause, FailureCause::Io { .. })),
        }
        assert!(destination.bytes()[PAGE as usize..][..4096] == file_bytes[..4096]);
        // The engine (its workers, the ring with the cancelled read) goes in bounded time.
        let start = std::time::Instant::now();
        drop(engine);
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
    }
}

/// One worker runs several batches in its ring at once: batches submitted behind one whose read
/// cannot complete run and settle while it waits (one batch at a time, they would all have
/// waited behind it), and it completes, byte-exact, once its bytes arrive.
#[test]
fn batches_behind_a_stuck_one_in_the_same_ring_run_and_settle_first() {
    let dir = support::temp_dir();
    if !support::backends("batches_behind_a_stuck_one").contains(&Backend::IoUring) {
        return;
    }
    let registry = EndpointRegistry::new();
    let config = umbp_ssd::SsdConfig {
        backend: Backend::IoUring,
        workers: 1,
        ..umbp_ssd::SsdConfig::default()
    };
    let engine = support::engine_with(&registry, config);
    // A FIFO: its read waits until the test writes to it.
    let fifo = dir.path().join("later.fifo");
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
    let stuck_reg = engine
        .register_file(FileSource::open(&fifo, FileOptions::new().direct(false)), 0, 1 << 20)
        .unwrap();
    let path = dir.path().join("fine.bin");
    let pages = 16;
    let file_bytes = support::pattern(29, (pages * PAGE) as usize);
    support::write_file(&path, &file_bytes);
    let fine_reg =
        engine.register_file(FileSource::open(&path, FileOptions::new()), 0, pages * PAGE).unwrap();
    let (stuck, fine) = (stuck_reg.id(), fine_reg.id());
    // Destination page 2i for the stuck batch's objects, page 2i + 1 for batch i behind it.
    let destination = HostBuf::new(&registry, (2 * pages * PAGE) as usize, 0, POISON);

    let mut builder = engine.builder();
    for (tag, file, at) in [(0u32, stuck, 0), (1, fine, 2 * PAGE)] {
        builder.begin_object(Tag::new(tag)).unwrap();
        builder.push(Fragment::new(file, 0, destination.id, at, 4096, Tag::new(tag))).unwrap();
        builder.commit_object().unwrap();
    }
    let stuck_handle = engine.submit(builder.finish().unwrap());
    let behind: Vec<_> = (0..pages)
        .map(|i| {
            let tag = Tag::new(i as u32);
            let f = Fragment::new(fine, i * PAGE, destination.id, (2 * i + 1) * PAGE, PAGE, tag);
            builder.begin_object(tag).unwrap();
            builder.push(f).unwrap();
            builder.commit_object().unwrap();
            engine.submit(builder.finish().unwrap())
        })
        .collect();
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !behind.iter().all(|h| h.is_done()) {
        assert!(std::time::Instant::now() < give_up, "the batches behind the stuck one wait");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(!stuck_handle.is_done(), "the FIFO read completed with nothing written");
    for (i, handle) in behind.into_iter().enumerate() {
        let failures = handle.into_settled().failures;
        assert!(failures.is_empty(), "batch {i}: {failures:?}");
        let got = &destination.bytes()[((2 * i + 1) as u64 * PAGE) as usize..][..PAGE as usize];
        assert!(got == &file_bytes[i * PAGE as usize..][..PAGE as usize], "page {i}");
    }

    // The stuck read's bytes arrive; its batch completes.
    let sent = support::pattern(31, 4096);
    std::fs::OpenOptions::new().write(true).open(&fifo).unwrap().write_all(&sent).unwrap();
    let failures = stuck_handle.into_settled().failures;
    assert!(failures.is_empty(), "{failures:?}");
    assert!(destination.bytes()[..4096] == sent[..]);
    assert!(destination.bytes()[(2 * PAGE) as usize..][..4096] == file_bytes[..4096]);
}

/// An engine of `workers` workers and a file of `pages` pattern pages (`seed`) registered with
/// it, whose read covering page `bad` panics.
struct PanickingFile {
    /// The file's registration, declared first so that it ends before the engine drops.
    _registration: umbp_plan::Registration<std::fs::File>,
    registry: std::sync::Arc<EndpointRegistry>,
    engine: SsdEngine,
    bytes: Vec<u8>,
    file: EndpointId,
}

impl PanickingFile {
    fn new(path: &Path, backend: Backend, workers: usize, pages: u64, seed: u64, bad: u64) -> Self {
        let registry = EndpointRegistry::new();
        let config = umbp_ssd::SsdConfig { backend, workers, ..umbp_ssd::SsdConfig::default() };
        let engine = support::engine_with(&registry, config);
        let bytes = support::pattern(seed, (pages * PAGE) as usize);
        support::write_file(path, &bytes);
        let registration = engine
            .register_file(FileSource::open(path, FileOptions::new()), 0, pages * PAGE)
            .unwrap();
        let file = registration.id();
        engine.inject_fault(IoFault::panic_covering(file, bad * PAGE + 5));
        Self { registry, engine, bytes, file, _registration: registration }
    }

    /// Submits one batch reading pages `first .. first + 4` into `destination` pages `slot`,
    /// `slot + 2`, `slot + 4`, `slot + 6`: one object per page, tagged 0 to 3.
    fn read_four(&self, destination: &HostBuf, first: u64, slot: u64) -> umbp_plan::TransferHandle {
        let mut builder = self.engine.builder();
        for k in 0..4 {
            let tag = Tag::new(k as u32);
            let (from, to) = ((first + k) * PAGE, (slot + 2 * k) * PAGE);
            builder.begin_object(tag).unwrap();
            builder.push(Fragment::new(self.file, from, destination.id, to, PAGE, tag)).unwrap();
            builder.commit_object().unwrap();
        }
        self.engine.submit(builder.finish().unwrap())
    }

    /// Whether `destination` pages `slot`, `slot + 2`, ... hold file pages `first .. first + 4`.
    fn landed(&self, destination: &HostBuf, first: u64, slot: u64) -> bool {
        (0..4).all(|k| {
            let got = &destination.bytes()[((slot + 2 * k) * PAGE) as usize..][..PAGE as usize];
            got == &self.bytes[((first + k) * PAGE) as usize..][..PAGE as usize]
        })
    }
}

/// Asserts that a batch of [`PanickingFile::read_four`] failed whole, with the panic as cause.
fn assert_failed_whole_by_panic(failures: &[umbp_plan::Failure], what: &str) {
    let tags: Vec<u32> = failures.iter().flat_map(|f| &f.tags).map(|t| t.get()).collect();
    assert_eq!(tags, [0, 1, 2, 3], "{what} failed in part: {failures:?}");
    let by_panic = |f: &umbp_plan::Failure| matches!(&f.cause, FailureCause::NotAccepted(why) if why.contains("a panic"));
    assert!(failures.iter().all(by_panic), "{what}: {failures:?}");
}

/// A batch that panics while others share its worker's ring fails whole, with the panic as the
/// cause; every other batch completes byte-exact (none hangs), the worker carries on, and the
/// next batches complete.
#[test]
fn a_batch_panicking_beside_others_in_its_ring_fails_alone() {
    let dir = support::temp_dir();
    for backend in support::backends("a_batch_panicking_beside_others") {
        let path = dir.path().join(format!("panics_{backend:?}.bin"));
        // Batch b reads pages 4b .. 4b + 4; the read of page 13 (batch 3) panics.
        let fx = PanickingFile::new(&path, backend, 1, 32, 37, 13);
        let destination = HostBuf::new(&fx.registry, (64 * PAGE) as usize, 0, POISON);
        let handles: Vec<_> = (0..6).map(|b| fx.read_four(&destination, 4 * b, 8 * b)).collect();
        for (b, handle) in (0u64..).zip(handles) {
            let failures = handle.into_settled().failures;
            if b == 3 {
                assert_failed_whole_by_panic(&failures, &format!("{backend:?}: batch {b}"));
                continue;
            }
            assert!(failures.is_empty(), "{backend:?}: batch {b} beside the panic failed");
            assert!(fx.landed(&destination, 4 * b, 8 * b), "{backend:?}: batch {b}");
        }
        // The worker carries on: the same reads, fault cleared, all complete.
        fx.engine.clear_faults();
        let failures = fx.read_four(&destination, 12, 24).into_settled().failures;
        assert!(failures.is_empty(), "{backend:?}: {failures:?}");
        assert!(fx.landed(&destination, 12, 24), "{backend:?}: batch 3 again");
    }
}

/// Sixteen threads submit batches to one engine with two workers while the read of one page
/// panics: exactly the batches that read that page fail (whole, with the panic as the cause),
/// every other batch lands byte-exact, and no handle hangs.
#[test]
fn sixteen_threads_lose_only_the_batches_that_read_the_panicking_page() {
    const THREADS: u64 = 16;
    const ROUNDS: u64 = 12;
    const PAGES: u64 = 64;
    const BAD: u64 = 13;
    let first_page = |t: u64, round: u64| (t * 5 + round * 7) % (PAGES - 3);
    let dir = support::temp_dir();
    for backend in support::backends("sixteen_threads_lose_only") {
        let path = dir.path().join(format!("sixteen_{backend:?}.bin"));
        let fx = PanickingFile::new(&path, backend, 2, PAGES, 41, BAD);
        let failed_batches = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (fx, failed_batches) = (&fx, &failed_batches);
                scope.spawn(move || {
                    // Four destination pages of its own, a gap after each.
                    let destination = HostBuf::new(&fx.registry, (8 * PAGE) as usize, 0, POISON);
                    for round in 0..ROUNDS {
                        let first = first_page(t, round);
                        let failures = fx.read_four(&destination, first, 0).into_settled().failures;
                        let what = format!("{backend:?}: thread {t} round {round}");
                        if (first..first + 4).contains(&BAD) {
                            assert_failed_whole_by_panic(&failures, &what);
                            failed_batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            continue;
                        }
                        assert!(failures.is_empty(), "{what}: {failures:?}");
                        assert!(fx.landed(&destination, first, 0), "{what}");
                    }
                });
            }
        });
        let expected = (0..THREADS)
            .flat_map(|t| (0..ROUNDS).map(move |r| first_page(t, r)))
            .filter(|&first| (first..first + 4).contains(&BAD))
            .count() as u64;
        assert!(expected > 0, "the test reads the panicking page at least once");
        assert_eq!(failed_batches.into_inner(), expected, "{backend:?}");
    }
}
