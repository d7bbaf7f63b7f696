//! Gather descriptors and the launch geometry the kernel and the simulator share.
//!
//! One launch copies a list of descriptors. Each descriptor is cut into slices of
//! [`SLICE_BYTES`]; each slice is one thread block. `block_starts[i]` is the first block of
//! descriptor `i`, so block `b` finds its descriptor by binary search and copies bytes
//! `(b - block_starts[i]) * SLICE_BYTES ..` of it. The kernel ([`GATHER_KERNEL_SOURCE`], on CUDA and HIP) and
//! the simulated device run exactly this mapping from exactly these arrays.

/// The gather kernel's source: one CUDA C++ file that both runtime compilers take, NVRTC for
/// NVIDIA GPUs and hiprtc for AMD GPUs (HIP kernels are CUDA syntax). Compiled at run time for
/// the device's own architecture.
pub const GATHER_KERNEL_SOURCE: &str = include_str!("gather.cu");

/// The gather kernel's entry point in [`GATHER_KERNEL_SOURCE`] (`extern "C"`, so unmangled).
pub const GATHER_KERNEL_NAME: &str = "umbp_gather";

/// One copy of the gather kernel: `len` bytes from device-visible address `src` to `dst`.
/// The layout (`repr(C)`, three `u64`) is what the kernel reads.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct GatherDescriptor {
    /// Device-visible source address.
    pub src: u64,
    /// Device-visible destination address.
    pub dst: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// Bytes one thread block copies: 256 threads, 16-byte vectors, 8 rounds.
pub const SLICE_BYTES: u64 = 32 * 1024;

/// Threads per block of the gather kernel.
pub const BLOCK_THREADS: u32 = 256;

/// The descriptors of one launch and their block table.
#[derive(Clone, Debug, Default)]
pub struct LaunchTable {
    /// The descriptors, none longer than the launch's byte bound.
    pub descriptors: Vec<GatherDescriptor>,
    /// First block of each descriptor, plus the total block count as a last entry.
    pub block_starts: Vec<u32>,
}

impl LaunchTable {
    /// Clears the table, keeping its buffers.
    pub fn clear(&mut self) {
        self.descriptors.clear();
        self.block_starts.clear();
    }

    /// Blocks the launch needs.
    pub fn blocks(&self) -> u32 {
        self.block_starts.last().copied().unwrap_or(0)
    }

    /// Bytes the launch copies.
    pub fn bytes(&self) -> u64 {
        self.descriptors.iter().map(|d| d.len).sum()
    }

    /// Appends `d`; the caller keeps the launch within its bounds.
    pub fn push(&mut self, d: GatherDescriptor) {
        if self.block_starts.is_empty() {
            self.block_starts.push(0);
        }
        let blocks = d.len.div_ceil(SLICE_BYTES) as u32;
        let start = self.blocks();
        self.descriptors.push(d);
        *self.block_starts.last_mut().expect("a start was pushed") = start;
        self.block_starts.push(start + blocks);
    }

    /// The descriptor and byte range block `block` copies: the same search the kernel does.
    pub fn slice_of(&self, block: u32) -> Option<(GatherDescriptor, u64, u64)> {
        self.slice_at(block).map(|(i, offset, len)| (self.descriptors[i], offset, len))
    }

    /// As [`slice_of`](Self::slice_of), with the descriptor's index instead of the descriptor.
    pub fn slice_at(&self, block: u32) -> Option<(usize, u64, u64)> {
        if block >= self.blocks() {
            return None;
        }
        // Last descriptor whose first block is at or before `block`.
        let i = self.block_starts[..self.descriptors.len()].partition_point(|&s| s <= block) - 1;
        let offset = u64::from(block - self.block_starts[i]) * SLICE_BYTES;
        Some((i, offset, (self.descriptors[i].len - offset).min(SLICE_BYTES)))
    }
}

/// Splits `descriptors` into launches of at most `max_bytes` each (a longer descriptor is cut
/// into pieces), calling `launch` with each filled table. Empty descriptors are dropped.
pub fn chunk_launches<E>(
    descriptors: &[GatherDescriptor],
    max_bytes: u64,
    table: &mut LaunchTable,
    mut launch: impl FnMut(&LaunchTable) -> Result<(), E>,
) -> Result<(), E> {
    let max_bytes = max_bytes.max(1);
    table.clear();
    let mut bytes = 0u64;
    for d in descriptors {
        let mut done = 0;
        while done < d.len {
            let room = max_bytes - bytes;
            let n = (d.len - done).min(room);
            table.push(GatherDescriptor { src: d.src + done, dst: d.dst + done, len: n });
            bytes += n;
            done += n;
            if bytes == max_bytes {
                launch(table)?;
                table.clear();
                bytes = 0;
            }
        }
    }
    if !table.descriptors.is_empty() {
        launch(table)?;
        table.clear();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(src: u64, len: u64) -> GatherDescriptor {
        GatherDescriptor { src, dst: src + (1 << 40), len }
    }

    #[test]
    fn blocks_map_back_to_their_descriptor_and_slice() {
        let mut t = LaunchTable::default();
        t.push(d(0, 100)); // 1 block
        t.push(d(1 << 20, 2 * SLICE_BYTES + 5)); // 3 blocks
        t.push(d(1 << 30, SLICE_BYTES)); // 1 block
        assert_eq!(t.block_starts, vec![0, 1, 4, 5]);
        assert_eq!(t.blocks(), 5);
        assert_eq!(t.slice_of(0), Some((d(0, 100), 0, 100)));
        assert_eq!(t.slice_of(3), Some((d(1 << 20, 2 * SLICE_BYTES + 5), 2 * SLICE_BYTES, 5)));
        assert_eq!(t.slice_of(4), Some((d(1 << 30, SLICE_BYTES), 0, SLICE_BYTES)));
        assert_eq!(t.slice_of(5), None);
    }

    #[test]
    fn launches_are_bounded_and_cover_every_byte_once() {
        let descriptors = [d(0, 10), d(1000, 25), d(5000, 7), d(9000, 0)];
        let mut table = LaunchTable::default();
        let mut launches = Vec::new();
        chunk_launches(&descriptors, 16, &mut table, |t| {
            assert!(t.bytes() <= 16);
            launches.push(t.descriptors.clone());
            Ok::<(), ()>(())
        })
        .unwrap();
        let flat: Vec<GatherDescriptor> = launches.concat();
        // Every source byte appears once, in order.
        let covered: Vec<u64> = flat.iter().flat_map(|x| x.src..x.src + x.len).collect();
        let expected: Vec<u64> = descriptors.iter().flat_map(|x| x.src..x.src + x.len).collect();
        assert_eq!(covered, expected);
        assert_eq!(launches.len(), 3, "42 bytes in launches of 16");
        assert!(flat.iter().all(|x| x.dst == x.src + (1 << 40)));
    }
}
