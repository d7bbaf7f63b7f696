//! Unaligned fragments (odd file offsets and lengths, host buffers off any block boundary) are
//! byte-correct with `O_DIRECT` through the bounce path, for writes (read-modify-write, several
//! fragments sharing blocks) and reads (including the file's unaligned last block).

mod support;

use support::{HostBuf, Rng, POISON};
use umbp_plan::{EndpointRegistry, Fragment, Tag};
use umbp_plan::{FileOptions, FileSource, Register};
use umbp_ssd::Backend;

/// Not a multiple of any block size: the last block is partial.
const FILE_LEN: u64 = (4 << 20) + 777;

/// Disjoint random ranges covering much of `0 .. limit`: (offset, len), odd sizes included.
fn disjoint_ranges(rng: &mut Rng, limit: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = rng.below(600);
    loop {
        let len = match rng.below(4) {
            0 => 1 + rng.below(16),
            1 => 4096 * (1 + rng.below(4)),
            _ => 1 + rng.below(20_000),
        };
        if at + len > limit {
            return out;
        }
        out.push((at, len));
        at += len + rng.below(3000);
    }
}

fn unaligned(backend: Backend, dir: &std::path::Path, seed: u64) {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, backend);
    let path = dir.join(format!("unaligned_{backend:?}_{seed}.bin"));
    let mut model = support::pattern(seed, FILE_LEN as usize);
    support::write_file(&path, &model);
    let file_reg = engine
        .register_file(FileSource::open(&path, FileOptions::new()), 0, FILE_LEN)
        .expect("open");
    let file = file_reg.id();
    let info = engine.file_info(file).expect("file info");
    assert!(info.direct, "the file must be O_DIRECT for this test");
    assert!(info.block_size > 1);

    let mut rng = Rng(seed);
    // Writes: disjoint file ranges (neighbours often share a block) from a misaligned source.
    let ranges = disjoint_ranges(&mut rng, FILE_LEN);
    let source_len: u64 = ranges.iter().map(|r| r.1).sum();
    let mut source = HostBuf::new(&registry, source_len as usize, 3, 0);
    let new_bytes = support::pattern(seed + 1, source_len as usize);
    source.bytes_mut().copy_from_slice(&new_bytes);
    let mut objects = Vec::new();
    let mut host_at = 0;
    for (i, chunk) in ranges.chunks(3).enumerate() {
        let tag = Tag::new(i as u32);
        let mut object = Vec::new();
        for &(offset, len) in chunk {
            object.push(Fragment::new(source.id, host_at, file, offset, len, tag));
            model[offset as usize..(offset + len) as usize]
                .copy_from_slice(&new_bytes[host_at as usize..(host_at + len) as usize]);
            host_at += len;
        }
        objects.push(object);
    }
    rng.shuffle(&mut objects);
    let outcome = support::transfer(&engine, &objects);
    assert!(outcome.failed_tags().is_empty(), "{outcome:?}");

    let on_disk = std::fs::read(&path).expect("read back the file");
    assert!(on_disk[..FILE_LEN as usize] == model[..], "the file differs after unaligned writes");
    // A write into the partial last block writes that whole block: the file may grow to the
    // block boundary, with zeros.
    let grown = &on_disk[FILE_LEN as usize..];
    assert!(grown.iter().all(|&b| b == 0) && (on_disk.len() as u64) < FILE_LEN + info.block_size);

    // Reads: random (possibly overlapping) file ranges into disjoint, misaligned destinations,
    // with gaps between them that must stay poisoned.
    let mut reads = Vec::new();
    let mut expected = Vec::new();
    let mut host_at = 0;
    for i in 0..300u32 {
        let len = match rng.below(3) {
            0 => 1 + rng.below(64),
            1 => 512 * (1 + rng.below(16)),
            _ => 1 + rng.below(30_000),
        };
        let offset = match rng.below(5) {
            0 => FILE_LEN - len, // up to the unaligned end of the file
            1 => 512 * rng.below((FILE_LEN - len) / 512),
            _ => rng.below(FILE_LEN - len),
        };
        reads.push(vec![Fragment::new(file, offset, source.id, 0, 0, Tag::new(i))]);
        expected.push((host_at, offset, len));
        host_at += len + rng.below(100);
    }
    let mut destination = HostBuf::new(&registry, host_at as usize + 64, 1, POISON);
    for (object, &(at, offset, len)) in reads.iter_mut().zip(&expected) {
        object[0] = Fragment::new(file, offset, destination.id, at, len, object[0].tag);
    }
    let outcome = support::transfer(&engine, &reads);
    assert!(outcome.failed_tags().is_empty(), "{outcome:?}");
    let mut want = vec![POISON; destination.bytes().len()];
    for &(at, offset, len) in &expected {
        want[at as usize..(at + len) as usize]
            .copy_from_slice(&model[offset as usize..(offset + len) as usize]);
    }
    assert!(destination.bytes() == &want[..], "unaligned reads differ ({backend:?})");
    destination.bytes_mut().fill(0);
}

#[test]
fn unaligned_fragments_are_byte_exact_with_o_direct() {
    let Some(dir) = support::direct_dir("unaligned_fragments_are_byte_exact_with_o_direct") else {
        return;
    };
    for backend in support::backends("unaligned_fragments_are_byte_exact_with_o_direct") {
        for seed in [1, 2, 3] {
            unaligned(backend, dir.path(), seed);
        }
    }
}
