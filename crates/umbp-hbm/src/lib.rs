//! The device (HBM) engine with a gather kernel of the umbp transfer engines. Not implemented yet: see the README.
#![deny(unsafe_code)]

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
