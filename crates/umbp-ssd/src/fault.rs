//! The fault-injection hook (cargo feature `fault-injection`): fail chosen operations with a
//! chosen errno, before they reach the kernel, so failure tests need no failing disk.
//!
//! Without the feature, [`Faults`] is empty and its check compiles to nothing.

#[cfg(feature = "fault-injection")]
pub(crate) use enabled::Faults;
#[cfg(feature = "fault-injection")]
pub use enabled::{FaultOp, FaultTrigger, IoFault};

#[cfg(not(feature = "fault-injection"))]
pub(crate) use disabled::Faults;

#[cfg(not(feature = "fault-injection"))]
mod disabled {
    use umbp_plan::EndpointId;

    use crate::op::Op;

    /// No faults: the feature is off.
    #[derive(Debug)]
    pub(crate) struct Faults;

    impl Faults {
        pub(crate) fn new() -> Self {
            Self
        }

        #[inline(always)]
        pub(crate) fn check(&self, _file: EndpointId, _op: &Op) -> Option<i32> {
            None
        }
    }
}

#[cfg(feature = "fault-injection")]
mod enabled {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, PoisonError};

    use umbp_plan::EndpointId;

    use crate::op::Op;
    use crate::sys::Dir;

    /// Which operations an [`IoFault`] matches.
    #[derive(Copy, Clone, Debug, PartialEq, Eq)]
    pub enum FaultOp {
        /// Reads from a file into memory.
        Read,
        /// Writes from memory into a file.
        Write,
        /// Both.
        Any,
    }

    /// When an [`IoFault`] fires.
    #[derive(Copy, Clone, Debug, PartialEq, Eq)]
    pub enum FaultTrigger {
        /// On the `n`-th matching operation the engine starts after the fault is injected,
        /// counting from 1, once.
        Nth(u64),
        /// On every matching operation whose bytes include byte `offset` of file endpoint
        /// `endpoint`.
        Covering {
            /// The file endpoint.
            endpoint: EndpointId,
            /// An offset inside the endpoint.
            offset: u64,
        },
    }

    /// A rule that fails chosen operations with `errno` instead of issuing them. An operation
    /// is one read or write of a plan segment (or of a piece of a segment longer than the
    /// engine's largest I/O); the failed segment's objects fail, the rest of the batch runs.
    #[derive(Copy, Clone, Debug, PartialEq, Eq)]
    pub struct IoFault {
        /// Which operations it matches.
        pub op: FaultOp,
        /// When it fires.
        pub trigger: FaultTrigger,
        /// The errno the failed operation reports.
        pub errno: i32,
    }

    impl IoFault {
        /// The `errno` of a fault that makes the engine's worker panic where the operation
        /// would start, instead of failing it: to test that a batch that panics fails whole and
        /// alone, settles, and that the worker carries on
        /// ([`panic_covering`](Self::panic_covering)).
        pub const PANIC: i32 = i32::MIN;

        /// Makes the worker panic when it starts a read covering byte `offset` of file endpoint
        /// `endpoint` (see [`PANIC`](Self::PANIC)).
        pub const fn panic_covering(endpoint: EndpointId, offset: u64) -> Self {
            Self::read_covering(endpoint, offset, Self::PANIC)
        }

        /// Fails the `n`-th read (from 1) with `errno`, once.
        pub const fn nth_read(n: u64, errno: i32) -> Self {
            Self { op: FaultOp::Read, trigger: FaultTrigger::Nth(n), errno }
        }

        /// Fails the `n`-th write (from 1) with `errno`, once.
        pub const fn nth_write(n: u64, errno: i32) -> Self {
            Self { op: FaultOp::Write, trigger: FaultTrigger::Nth(n), errno }
        }

        /// Fails every read covering byte `offset` of file endpoint `endpoint` with `errno`.
        pub const fn read_covering(endpoint: EndpointId, offset: u64, errno: i32) -> Self {
            Self { op: FaultOp::Read, trigger: FaultTrigger::Covering { endpoint, offset }, errno }
        }

        /// Fails every write covering byte `offset` of file endpoint `endpoint` with `errno`.
        pub const fn write_covering(endpoint: EndpointId, offset: u64, errno: i32) -> Self {
            Self { op: FaultOp::Write, trigger: FaultTrigger::Covering { endpoint, offset }, errno }
        }
    }

    /// An armed fault and the matching operations it has seen.
    #[derive(Debug)]
    struct Armed {
        fault: IoFault,
        seen: u64,
        fired: bool,
    }

    /// The engine's injected faults.
    #[derive(Debug, Default)]
    pub(crate) struct Faults {
        /// Whether any fault is armed: one relaxed load per operation when none is. Relaxed is
        /// enough: the rules themselves are read under the mutex, which orders them.
        armed: AtomicBool,
        rules: Mutex<Vec<Armed>>,
    }

    impl Faults {
        pub(crate) fn new() -> Self {
            Self::default()
        }

        pub(crate) fn inject(&self, fault: IoFault) {
            let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
            rules.push(Armed { fault, seen: 0, fired: false });
            self.armed.store(true, Ordering::Relaxed);
        }

        pub(crate) fn clear(&self) {
            let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
            rules.clear();
            self.armed.store(false, Ordering::Relaxed);
        }

        /// The errno to fail `op` (on file endpoint `file`) with, if a fault matches it. Panics
        /// if the matching fault is an [`IoFault::PANIC`].
        pub(crate) fn check(&self, file: EndpointId, op: &Op) -> Option<i32> {
            let errno = self.matching(file, op);
            if errno == Some(IoFault::PANIC) {
                panic!("injected fault: the worker panics starting a read of {}", file.raw());
            }
            errno
        }

        /// The errno of the first fault matching `op`, counting it as seen by every rule.
        fn matching(&self, file: EndpointId, op: &Op) -> Option<i32> {
            if !self.armed.load(Ordering::Relaxed) {
                return None;
            }
            let mut rules = self.rules.lock().unwrap_or_else(PoisonError::into_inner);
            let mut errno = None;
            for armed in rules.iter_mut() {
                let kind = match armed.fault.op {
                    FaultOp::Any => true,
                    FaultOp::Read => op.dir() == Dir::Read,
                    FaultOp::Write => op.dir() == Dir::Write,
                };
                if !kind {
                    continue;
                }
                let fires = match armed.fault.trigger {
                    FaultTrigger::Nth(n) => {
                        armed.seen += 1;
                        armed.seen == n && !armed.fired
                    }
                    FaultTrigger::Covering { endpoint, offset } => {
                        endpoint == file
                            && offset >= op.endpoint_offset
                            && offset - op.endpoint_offset < op.len()
                    }
                };
                if fires && errno.is_none() {
                    armed.fired = true;
                    errno = Some(armed.fault.errno);
                }
            }
            errno
        }
    }
}
