//! CRC32C of the bytes an engine copies, computed while it copies them: the joining arithmetic
//! and the sink through which an engine reports what it hashed.
//!
//! A composite that verifies block checksums needs the CRC32C (Castagnoli) of each object's
//! bytes. Hashing them in a second pass reads every byte from memory twice, which on a restore
//! from host memory costs about as much as the copy itself. An engine that copies on the CPU
//! can hash the bytes while they are in its registers instead
//! ([`host_copy::copy_streaming_crc`](crate::host_copy::copy_streaming_crc)). It says so through
//! [`TransferEngine::hashes_while_copying`](crate::TransferEngine::hashes_while_copying), and a
//! plan set then carries a [`CopyHashes`] sink that it reports each copied piece's CRC to.
//!
//! Pieces are hashed apart, in whatever order the engine copies them, and joined later by
//! [`combine`]: `combine(crc(a), crc(b), b.len()) == crc(a ‖ b)`. It takes one carry-less
//! multiplication per set bit of the length, which is what lets an engine report thousands of
//! pieces per restore (the `crc32c` crate's `crc32c_combine` squares a 32 × 32 bit matrix per
//! bit of the length, some microseconds a call).

use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::{Plan, Segment, Tag};

/// CRC32C's polynomial, bit-reflected (the form the CPU's `crc32` instruction uses).
const POLY: u32 = 0x82F6_3B78;

/// `a · b mod P` over GF(2), both in CRC32C's reflected representation (bit 31 is x⁰). Free
/// of data-dependent branches.
const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut i = 0;
    while i < 32 {
        // Bit 31 - i of `a` is the coefficient of xⁱ.
        product ^= b & ((a >> (31 - i)) & 1).wrapping_neg();
        // b · x
        b = (b >> 1) ^ (POLY & (b & 1).wrapping_neg());
        i += 1;
    }
    product
}

/// `x^(2^k) mod P` for k = 0 ..= 66, reflected: enough for 8 · any `u64` byte count.
const POWERS: [u32; 67] = {
    let mut powers = [0u32; 67];
    // x¹ is bit 30 in the reflected representation.
    let mut p = 1u32 << 30;
    let mut k = 0;
    while k < 67 {
        powers[k] = p;
        p = multiply(p, p);
        k += 1;
    }
    powers
};

/// `x^(8 · bytes) mod P`, reflected: what shifting a CRC register over `bytes` zero bytes
/// multiplies it by.
pub(crate) fn zeros_operator(bytes: u64) -> u32 {
    // x^(8n) = product of x^(2^(k+3)) over the set bits k of n.
    let mut op = 1u32 << 31; // x⁰
    let mut n = bytes;
    let mut k = 3;
    while n != 0 {
        if n & 1 != 0 {
            op = multiply(POWERS[k], op);
        }
        n >>= 1;
        k += 1;
    }
    op
}

/// The CRC32C of `prior ‖ bytes`, from `crc = crc32c(prior)` (0 for no prior bytes): what
/// every engine hashes with where it does not hash inside its copy loop.
///
/// `crc-fast` computes it: it folds 64 bytes at a time with carry-less multiplications (512-bit
/// `VPCLMULQDQ` where the CPU has it, else 128-bit `PCLMULQDQ`) beside `crc32` instruction
/// chains, detected at run time. Measured on this project's 2-vCPU Xeon (AVX-512, VPCLMULQDQ),
/// one thread, from the cache: 98–102 GB/s on 64 KiB and 76 on 4 KiB, where the `crc32c`
/// crate's three `crc32` chains run 24.5–24.9 and 21.9 GB/s. A CRC the sealed channel takes
/// over a record it has just encrypted, or a get's over what it has just opened, then costs a
/// quarter of what it did. Below about 256 bytes a call's setup (some 15 ns) makes it slower
/// than the `crc32c` crate (22 against 6.5 ns for 16 bytes); only a hashing copy's unaligned
/// head and short tail are that small, next to a copy of at least 16 KiB.
///
/// ```
/// use umbp_plan::checksum::crc32c_append;
///
/// // CRC-32C's check value, whole and in two pieces.
/// assert_eq!(crc32c_append(0, b"123456789"), 0xe306_9283);
/// assert_eq!(crc32c_append(crc32c_append(0, b"1234"), b"56789"), 0xe306_9283);
/// ```
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    // The register is the CRC before its final inversion.
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(bytes);
    digest.finalize() as u32
}

/// The CRC32C of `a ‖ b`, from `crc_a` (of `a`), `crc_b` (of `b`) and `b`'s length. As the
/// `crc32c` crate's `crc32c_combine`, in a few dozen nanoseconds for any length.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    multiply(zeros_operator(len_b), crc_a) ^ crc_b
}

/// A CRC register shifted over a fixed number of zero bytes, as four 256-entry tables: one
/// table lookup per byte of the register. For joins inside a copy kernel, where even the
/// few dozen operations of [`combine`] would show.
pub(crate) struct ShiftTables([[u32; 256]; 4]);

impl ShiftTables {
    /// The tables of a shift over `bytes` zero bytes.
    pub(crate) fn new(bytes: u64) -> Self {
        let op = zeros_operator(bytes);
        let mut tables = [[0u32; 256]; 4];
        for (j, table) in tables.iter_mut().enumerate() {
            for (b, entry) in table.iter_mut().enumerate() {
                *entry = multiply(op, (b as u32) << (8 * j));
            }
        }
        Self(tables)
    }

    /// `register` shifted over the tables' zero bytes.
    #[inline(always)]
    pub(crate) fn shift(&self, register: u32) -> u32 {
        let [t0, t1, t2, t3] = &self.0;
        t0[(register & 0xff) as usize]
            ^ t1[((register >> 8) & 0xff) as usize]
            ^ t2[((register >> 16) & 0xff) as usize]
            ^ t3[(register >> 24) as usize]
    }

    /// The tables for 4 KiB, built once per process.
    pub(crate) fn page() -> &'static Self {
        static PAGE: OnceLock<ShiftTables> = OnceLock::new();
        PAGE.get_or_init(|| Self::new(4096))
    }
}

/// The receiver of an engine's checksums: given to a plan set
/// ([`PlanSet::set_copy_hashes`](crate::PlanSet::set_copy_hashes)), called by an engine that
/// [hashes while copying](crate::TransferEngine::hashes_while_copying) once for each piece it
/// copied: the plan, the object, the piece (inside one of the plan's segments, in the plan's
/// coordinates) and the CRC32C of the bytes it read for it (from zero: `crc32c(bytes)`).
///
/// Calls come from the engine's threads, in any order, before the submit's handle completes;
/// an engine may cut an object's piece into smaller ones. Keep it short: it runs inside the
/// copy loop's caller.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use umbp_plan::checksum::CopyHashes;
///
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let log = Arc::clone(&seen);
/// let sink = CopyHashes::new(move |_plan, tag, piece, crc| {
///     log.lock().unwrap().push((tag, piece.len, crc));
/// });
/// assert_eq!(sink, sink.clone());
/// ```
#[derive(Clone)]
pub struct CopyHashes(Arc<Receive>);

/// What a [`CopyHashes`] calls: (plan, object, piece, CRC).
type Receive = dyn Fn(&Plan, Tag, Segment, u32) + Send + Sync;

impl CopyHashes {
    /// A sink that calls `receive(plan, tag, piece, crc)` for each hashed piece.
    pub fn new(receive: impl Fn(&Plan, Tag, Segment, u32) + Send + Sync + 'static) -> Self {
        Self(Arc::new(receive))
    }

    /// Reports that `piece` of object `tag` in `plan` was copied, its source bytes hashing to
    /// `crc`.
    pub fn copied(&self, plan: &Plan, tag: Tag, piece: Segment, crc: u32) {
        (self.0)(plan, tag, piece, crc);
    }
}

impl fmt::Debug for CopyHashes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CopyHashes")
    }
}

/// Two sinks are equal when they are clones of one another.
impl PartialEq for CopyHashes {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CopyHashes {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).rotate_left(7) as u8)
            .collect()
    }

    proptest! {
        /// `crc32c_append` hashes as the `crc32c` crate does, from any prior CRC, at every
        /// length (short tails, the folding loops' block sizes and what is between).
        #[test]
        fn append_matches_the_crc32c_crate(len in 0usize..20_000, prior: u32, seed: u32) {
            let data = bytes(len, seed);
            prop_assert_eq!(crc32c_append(prior, &data), crc32c::crc32c_append(prior, &data));
        }

        /// `combine` joins two pieces' CRCs into the whole's, as the `crc32c` crate does.
        #[test]
        fn combine_matches_hashing_the_whole(a in 0usize..3000, b in 0usize..20_000, seed: u32) {
            let data = bytes(a + b, seed);
            let (x, y) = data.split_at(a);
            let joined = combine(crc32c::crc32c(x), crc32c::crc32c(y), b as u64);
            prop_assert_eq!(joined, crc32c::crc32c(&data));
            prop_assert_eq!(joined, crc32c::crc32c_combine(crc32c::crc32c(x), crc32c::crc32c(y), b));
        }

        /// A register shifted by the tables equals it advanced over that many zero bytes by the
        /// instruction (`!crc32c_append(!r, zeros)` is the raw register's update).
        #[test]
        fn shift_tables_advance_a_register_over_zeros(register: u32, bytes in 1u64..9000) {
            let zeros = vec![0u8; bytes as usize];
            let want = !crc32c::crc32c_append(!register, &zeros);
            prop_assert_eq!(ShiftTables::new(bytes).shift(register), want);
        }
    }

    #[test]
    fn lengths_past_four_gib_combine_like_the_crate() {
        let (a, b) = (0x1234_5678, 0x9abc_def0);
        for len in [1u64 << 32, (1 << 33) + 4097, u64::MAX >> 20] {
            assert_eq!(combine(a, b, len), crc32c::crc32c_combine(a, b, len as usize));
        }
    }
}
