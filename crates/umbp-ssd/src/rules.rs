//! What the engine plans: the pairs it carries and its largest segment.

use umbp_plan::{Endpoint, PlanRules};

/// The planning rules of the SSD engine: file to host memory (restore) and host memory to file
/// (offload), segments of at most the configured maximum. Alignment is not a planning rule:
/// unaligned pieces of `O_DIRECT` files go through the engine's bounce buffers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SsdRules {
    max_segment: u64,
}

impl SsdRules {
    /// Rules with segments of at most `max_segment` bytes.
    pub const fn new(max_segment: u64) -> Self {
        Self { max_segment }
    }
}

impl PlanRules for SsdRules {
    #[inline]
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        (src.file_range().is_some() && dst.is_host())
            || (src.is_host() && dst.file_range().is_some())
    }

    #[inline]
    fn max_segment_len(&self) -> u64 {
        self.max_segment
    }
}

#[cfg(test)]
mod tests {
    use umbp_plan::{DeviceOrdinal, Endpoint, PlanRules};

    use super::SsdRules;

    #[test]
    fn carries_file_host_pairs_only() {
        let rules = SsdRules::new(1 << 20);
        let file = Endpoint::file(3, 0, 4096, true);
        let host = Endpoint::host(0x1000, 4096);
        let device = Endpoint::device(DeviceOrdinal::new(0), 0x1000, 4096);
        let table = [
            (file, host, true),
            (host, file, true),
            (host, host, false),
            (file, file, false),
            (file, device, false),
            (device, file, false),
        ];
        for (src, dst, carried) in table {
            assert_eq!(rules.carries(&src, &dst), carried, "{src:?} -> {dst:?}");
        }
        assert_eq!(rules.max_segment_len(), 1 << 20);
    }
}
