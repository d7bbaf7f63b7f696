//! The restore shape the benchmarks use, and a page allocator that scatters objects over a tier.

/// The shape of a restore: `objects` objects, each read as `ranges` ranges of `range_len` bytes,
/// stored in pages of `page_size` bytes. Range `r` of object `b` goes to destination `r` at
/// offset `b × range_len`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct RestoreShape {
    /// Objects restored.
    pub objects: usize,
    /// Ranges read per object (one per layer group).
    pub ranges: usize,
    /// Bytes per range.
    pub range_len: u64,
    /// Page size of the tier.
    pub page_size: u64,
}

impl RestoreShape {
    /// Kimi-K3 at TP8 with an FP8 KV cache: 999,936 tokens in 1,536-token objects (651 objects),
    /// 24 ranges of 1 MiB each.
    pub const fn kimi_k3(page_size: u64) -> Self {
        Self { objects: 651, ranges: 24, range_len: 1 << 20, page_size }
    }

    /// Bytes stored per object.
    pub fn object_size(&self) -> u64 {
        self.ranges as u64 * self.range_len
    }

    /// Pages per object (the last one may be short).
    pub fn pages_per_object(&self) -> usize {
        self.object_size().div_ceil(self.page_size) as usize
    }

    /// Page fragments one restore produces when ranges start on page boundaries.
    pub fn fragments(&self) -> u64 {
        (self.objects * self.ranges) as u64 * self.range_len.div_ceil(self.page_size)
    }

    /// Total bytes restored.
    pub fn bytes(&self) -> u64 {
        self.objects as u64 * self.object_size()
    }
}

/// A splitmix64 generator, so every layout is a pure function of its seed.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A number in `0 .. n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Every object's page list over one tier, as tier byte offsets, laid out flat.
#[derive(Clone, Debug)]
pub struct PageTable {
    pages: Vec<u64>,
    per_object: usize,
    /// Pages the tier holds (allocated or free).
    pub tier_pages: u64,
    /// Fraction of consecutive page pairs inside an object that ended up adjacent in the tier.
    pub adjacent_fraction: f64,
}

impl PageTable {
    /// Places `shape`'s objects over a tier of exactly the pages they need. Each pair of
    /// consecutive pages of an object is adjacent in the tier with probability `contiguity`:
    /// objects are cut into runs of adjacent pages, and the runs of all objects are laid out in
    /// a random order.
    pub fn scatter(shape: &RestoreShape, contiguity: f64, seed: u64) -> Self {
        let per_object = shape.pages_per_object();
        let needed = shape.objects * per_object;
        let mut rng = SplitMix(seed);
        // (first page index of the run inside the flat table, run length)
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for object in 0..shape.objects {
            let mut start = object * per_object;
            for k in 1..=per_object {
                if k == per_object || rng.unit() >= contiguity {
                    runs.push((start, object * per_object + k - start));
                    start = object * per_object + k;
                }
            }
        }
        for i in (1..runs.len()).rev() {
            runs.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut pages = vec![0u64; needed];
        let mut next_free = 0u64;
        for (start, len) in runs {
            for (k, page) in pages[start..start + len].iter_mut().enumerate() {
                *page = (next_free + k as u64) * shape.page_size;
            }
            next_free += len as u64;
        }
        let adjacent = pages
            .chunks(per_object)
            .flat_map(|object| object.windows(2))
            .filter(|w| w[1] == w[0] + shape.page_size)
            .count();
        let pairs = (shape.objects * per_object.saturating_sub(1)).max(1) as f64;
        Self {
            pages,
            per_object,
            tier_pages: needed as u64,
            adjacent_fraction: adjacent as f64 / pairs,
        }
    }

    /// The page list of object `index`.
    pub fn object(&self, index: usize) -> &[u64] {
        &self.pages[index * self.per_object..(index + 1) * self.per_object]
    }
}
