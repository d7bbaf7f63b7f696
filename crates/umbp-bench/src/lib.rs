//! The workloads behind the `umbp-bench` command and the criterion benches.
//!
//! Each subcommand has a module that builds its workload, measures it and returns rows that the
//! command prints as a table or as JSON lines. Targets are checked as ratios inside one run.

pub mod alloc_count;
pub mod copy_bench;
pub mod hbm_bench;
pub mod plan_bench;
pub mod restore_bench;
pub mod shape;
pub mod size;
