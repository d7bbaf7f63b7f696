//! Build script: turns "feature `hip` on a Linux target" into the short cfg `hip_backend`, and
//! links libhiprtc where the ROCm installation has one (ROCm 5.3 and later; in 5.2 hiprtc is
//! part of libamdhip64, which hip-runtime-sys links).

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(hip_backend)");
    println!("cargo:rerun-if-env-changed=HIP_PATH");
    println!("cargo:rerun-if-env-changed=ROCM_PATH");
    let hip = env::var_os("CARGO_FEATURE_HIP").is_some();
    let linux = env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
    if !(hip && linux) {
        return;
    }
    println!("cargo:rustc-cfg=hip_backend");
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["HIP_PATH", "ROCM_PATH"] {
        if let Some(root) = env::var_os(var) {
            dirs.push(PathBuf::from(&root).join("lib"));
        }
    }
    dirs.extend(
        ["/opt/rocm/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"].map(PathBuf::from),
    );
    if let Some(dir) = dirs.iter().find(|d| d.join("libhiprtc.so").exists()) {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-lib=dylib=hiprtc");
    }
}
