//! A batch whose object count needs more memory than the process may take gets a typed error,
//! not an abort. The test runs itself again in a child process limited to 3 GiB of address
//! space (`ulimit -v`), where the 4 GiB of states a batch of 2^32 objects needs cannot exist.

use std::process::Command;

use umbp_localcopy::{Error, LocalCopyEngine};
use umbp_plan::EndpointRegistry;

/// Set in the child process, which makes the batch.
const CHILD: &str = "UMBP_LOCALCOPY_HUGE_BATCH_CHILD";
/// What the child prints once the batch was refused with the typed error.
const REFUSED: &str = "refused with a typed error";

#[test]
fn a_batch_of_2_pow_32_objects_without_the_memory_is_a_typed_error() {
    if std::env::var_os(CHILD).is_some() {
        let engine = LocalCopyEngine::new(EndpointRegistry::new());
        let refused = engine.transfer_batch(1 << 32, &[]);
        assert!(
            matches!(refused, Err(Error::OutOfMemory { what: "object states", count }) if count == 1 << 32),
            "{refused:?}"
        );
        println!("{REFUSED}");
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let child = Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -v 3145728 && exec "$0" --exact "$1" --nocapture --test-threads=1"#)
        .arg(exe)
        .arg("a_batch_of_2_pow_32_objects_without_the_memory_is_a_typed_error")
        .env(CHILD, "1")
        .output()
        .expect("sh runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    let stderr = String::from_utf8_lossy(&child.stderr);
    assert!(child.status.success(), "the child failed: {}\n{stdout}\n{stderr}", child.status);
    assert!(stdout.contains(REFUSED), "the child did not reach the batch:\n{stdout}\n{stderr}");
}
