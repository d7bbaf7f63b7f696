//! Worker placement ([`SsdConfig::worker_cpus`]): pinned workers run only on their CPUs and
//! read byte-exact; a CPU the process may not use is a typed error, on io_uring and on the
//! fallback.

mod support;

use support::{HostBuf, POISON};
use umbp_plan::{EndpointRegistry, FileOptions, FileSource, Fragment, Register, Tag};
use umbp_ssd::{Error, SsdConfig, SsdEngine};

/// A kernel CPU list (`0-3,8,10-11`) as numbers.
fn cpu_list(list: &str) -> Vec<usize> {
    list.trim()
        .split(',')
        .filter(|part| !part.is_empty())
        .flat_map(|part| {
            let (first, last) = part.split_once('-').unwrap_or((part, part));
            let (first, last): (usize, usize) =
                (first.parse().expect("a CPU number"), last.parse().expect("a CPU number"));
            first..=last
        })
        .collect()
}

/// The `Cpus_allowed_list` of a `/proc/.../status` file.
fn allowed_cpus(status: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(status).expect("read the status file");
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("a Cpus_allowed_list line");
    cpu_list(line)
}

/// The CPUs each thread of this process named `name-<i>` may run on.
fn threads_named(name: &str) -> Vec<Vec<usize>> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("list the threads") {
        let task = task.expect("a thread").path();
        let Ok(comm) = std::fs::read_to_string(task.join("comm")) else { continue };
        let index = comm.trim().strip_prefix(name).and_then(|rest| rest.strip_prefix('-'));
        // Workers only (`name-0`, `name-1`...): the queue's watcher is `name-watch`.
        if index.is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit())) {
            found.push(allowed_cpus(task.join("status").to_str().expect("a UTF-8 path")));
        }
    }
    found
}

#[test]
fn pinned_workers_run_on_their_cpus_and_read_exactly() {
    let allowed = allowed_cpus("/proc/self/status");
    let cpu = *allowed.last().expect("the process may run somewhere");
    for backend in support::backends("pinned_workers_run_on_their_cpus_and_read_exactly") {
        let name = format!("pin{}", matches!(backend, umbp_ssd::Backend::Blocking) as u8);
        let registry = EndpointRegistry::new();
        let config = SsdConfig {
            backend,
            workers: 3,
            worker_cpus: vec![cpu],
            name: name.clone(),
            ..SsdConfig::default()
        };
        let engine = SsdEngine::new(registry.clone(), config).expect("pinned workers start");
        let pinned = threads_named(&name);
        assert_eq!(pinned, vec![vec![cpu]; 3], "every worker may run on CPU {cpu} only");

        let dir = support::temp_dir();
        let path = dir.path().join("placement.bin");
        let pattern = support::pattern(11, 1 << 20);
        support::write_file(&path, &pattern);
        let file = engine
            .register_file(FileSource::open(&path, FileOptions::new().writable(false)), 0, 1 << 20)
            .expect("open");
        let host = HostBuf::new(&registry, 1 << 20, 0, POISON);
        let objects: Vec<Vec<Fragment>> = (0..16u64)
            .map(|o| {
                let tag = Tag::new(o as u32);
                vec![Fragment::new(file.id(), o << 16, host.id, (15 - o) << 16, 1 << 16, tag)]
            })
            .collect();
        let outcome = support::transfer(&engine, &objects);
        assert!(outcome.failed_tags().is_empty(), "{outcome:?}");
        for o in 0..16usize {
            let (at, from) = ((15 - o) << 16, o << 16);
            assert!(host.bytes()[at..at + (1 << 16)] == pattern[from..from + (1 << 16)]);
        }
    }
}

#[test]
fn a_cpu_the_process_may_not_use_is_a_typed_error() {
    let allowed = allowed_cpus("/proc/self/status");
    let start = |cpus: Vec<usize>| {
        SsdEngine::new(
            EndpointRegistry::new(),
            SsdConfig { workers: 2, worker_cpus: cpus, ..SsdConfig::default() },
        )
    };
    // Beyond what a CPU set can name: refused before any thread starts.
    assert!(matches!(start(vec![0, 1024]), Err(Error::InvalidConfig(_))));
    // A CPU outside the allowed set (the highest a set can name, unless this process may run
    // there): the kernel refuses the pin.
    if allowed.contains(&1023) {
        eprintln!("skipping the refused-CPU case: this process may run on CPU 1023");
        return;
    }
    match start(vec![allowed[0], 1023]) {
        Err(Error::Affinity { cpu: 1023, source }) => {
            assert_eq!(source.raw_os_error(), Some(libc::EINVAL), "{source}");
        }
        other => panic!("expected Error::Affinity for CPU 1023, got {other:?}"),
    }
}
