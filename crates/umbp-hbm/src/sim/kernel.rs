//! The gather kernel, executed on the CPU block by block as a GPU executes `gather.cu`.

use umbp_plan::checksum::crc32c_append;
use umbp_plan::host_copy::{
    copy_non_temporal, copy_non_temporal_crc, non_temporal_supported, store_fence,
};

use crate::LaunchTable;

/// In launches of at least [`STREAM_LAUNCH`] bytes, slice bodies of at least this many bytes
/// are written with streaming stores (the host-copy engine's default threshold).
const STREAM_FROM: usize = 2 << 10;

/// Launches that move at least this many bytes stream their slices: a GPU's copy does not pass
/// through the CPU's caches, and for a restore far larger than the cache a `memcpy` of each
/// 32 KiB slice reads every destination line before writing it. With streaming, a simulated
/// restore from DRAM runs as fast as the same pages gathered by one thread with the best copy
/// (`umbp-bench restore`), where it ran at 0.8 of that. Smaller launches keep `memcpy`: their
/// destination stays in the cache, where plain stores are faster (`umbp-bench batch`, 4,096
/// transfers of 4 KiB in one 16 MiB launch, took twice the overhead when streamed).
///
/// The launch decides, not the restore: a restore in layer groups launches once per group, so
/// one in groups under 32 MiB copies with `memcpy` throughout. From DRAM, 24 groups of 16 MiB
/// ran at 0.59–0.63 of the same objects in one group (`crates/umbp-py/bench/restore_bench.py`
/// before it moved to one group). A GPU's copy is the same in both; compare layer-wise
/// figures on the simulated device with layer-wise ones only.
const STREAM_LAUNCH: u64 = 32 << 20;

/// Runs every block of `table`; with `crcs` (one per descriptor), also sets each to the
/// CRC32C of its descriptor's bytes, hashed while they are copied.
///
/// Blocks run in order, and the blocks of one descriptor (found by the kernel's own mapping
/// from its first block) as one copy: the same bytes as slice by slice, since every slice but
/// the last is a whole number of vectors, and one call per descriptor streams faster than one
/// per 32 KiB slice: 9.6 against 8.7 GiB/s for 64 KiB descriptors scattered over 1 GiB, where
/// hashing while copying costs +3 % of the copy in 64 KiB calls and +10 % in 32 KiB ones.
///
/// # Safety
///
/// Every descriptor's source is readable and destination writable for its length, and no
/// destination overlaps a source or another destination.
pub(super) unsafe fn run(table: &LaunchTable, mut crcs: Option<&mut [u32]>) {
    let stream = table.bytes() >= STREAM_LAUNCH && non_temporal_supported();
    let stream_from = if stream { STREAM_FROM } else { usize::MAX };
    if let Some(crcs) = crcs.as_deref_mut() {
        crcs.fill(0);
    }
    let mut streamed = false;
    let mut block = 0;
    while block < table.blocks() {
        // The kernel's own mapping: find the descriptor, then the slice of it.
        let Some((i, offset, _)) = table.slice_at(block) else { break };
        let d = table.descriptors[i];
        let crc = crcs.as_deref_mut().and_then(|c| c.get_mut(i));
        // SAFETY: bytes `offset ..` of the descriptor, which the caller vouches for.
        streamed |=
            unsafe { copy_slice(d.src + offset, d.dst + offset, d.len - offset, stream_from, crc) };
        // The descriptor's last block was copied: on to the next descriptor's first.
        block = table.block_starts[i + 1];
    }
    if streamed {
        // The launch's completion (its return, an event) publishes the bytes.
        store_fence();
    }
}

/// One block's copy (or the copy of a descriptor's consecutive blocks), split as the kernel
/// splits each: a body of 16-byte vectors when both addresses are 16-byte aligned, of 4-byte
/// words when both are 4-byte aligned, of bytes otherwise, then the tail bytewise. The body moves with one `memcpy` here, or with streaming
/// stores from `stream_from` bytes up (the bytes are the same whatever the width, and the
/// simulator should not be slower than the copies it is compared with); the tail goes byte by
/// byte, as on the GPU. With `crc`, extends it with the slice's bytes. Returns whether it
/// streamed (the caller fences).
///
/// # Safety
///
/// `src .. + len` readable, `dst .. + len` writable, not overlapping; `stream_from` below
/// `usize::MAX` only where [`non_temporal_supported`] said so.
unsafe fn copy_slice(
    src: u64,
    dst: u64,
    len: u64,
    stream_from: usize,
    mut crc: Option<&mut u32>,
) -> bool {
    let (s, d, n) = (src as *const u8, dst as *mut u8, len as usize);
    let width = match src | dst {
        a if a % 16 == 0 => 16,
        a if a % 4 == 0 => 4,
        _ => 1,
    };
    let body = n - n % width;
    let stream = body >= stream_from;
    // Bytes of the slice whose CRC is taken yet.
    let mut hashed = 0;
    match (stream, crc.as_deref_mut()) {
        (true, Some(crc)) => {
            // SAFETY: `body <= n`: inside both ranges, which do not overlap (caller's
            // contract); the CPU has the instructions (caller's contract on `stream_from`).
            *crc = unsafe { copy_non_temporal_crc(s, d, body, *crc) };
            hashed = body;
        }
        // SAFETY: as above.
        (true, None) => unsafe { copy_non_temporal(s, d, body) },
        // SAFETY: `body <= n`: inside both ranges, which do not overlap (caller's contract).
        (false, _) => unsafe { std::ptr::copy_nonoverlapping(s, d, body) },
    }
    for i in body..n {
        // SAFETY: `i < n`: inside both ranges.
        unsafe { d.add(i).write(s.add(i).read()) };
    }
    if let (Some(crc), true) = (crc, hashed < n) {
        // SAFETY: bytes `hashed .. n` of the source: readable, and nothing writes them (the
        // destination does not overlap them); not empty, so the pointer is non-null.
        let rest = unsafe { std::slice::from_raw_parts(s.add(hashed), n - hashed) };
        *crc = crc32c_append(*crc, rest);
    }
    stream
}
