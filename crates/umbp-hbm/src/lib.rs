//! umbp-hbm: not implemented yet. See the workspace README for the plan of this crate.
#![deny(unsafe_code)]
