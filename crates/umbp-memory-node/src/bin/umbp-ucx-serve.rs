//! `umbp-ucx-serve`: a memory node (`umbp-ucx-serve --help`; docs/MEMORY-NODE.md).

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(umbp_memory_node::serve::main(std::env::args_os()))
}
