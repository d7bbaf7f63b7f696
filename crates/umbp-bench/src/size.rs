//! Byte sizes with units on the command line: `4096`, `64KiB`, `1MiB`, `1.5GiB`, `2GB`
//! (`K`, `KB`: 1000; `Ki`, `KiB`: 1024).

use std::fmt;
use std::str::FromStr;

/// A byte count parsed from a number with an optional unit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    /// A number with an optional unit, read by the `parse-size` crate as everywhere in umbp:
    /// decimal units (`K`, `KB`, `M`, `MB`, ...) are powers of 1000, binary ones (`Ki`,
    /// `KiB`, `Mi`, `MiB`, ...) powers of 1024; any case, spaces allowed.
    fn from_str(s: &str) -> Result<Self, String> {
        parse_size::parse_size(s.trim())
            .map(ByteSize)
            .map_err(|e| format!("`{s}` is not a size: {e}"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (unit, scale) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
            if b >= scale && b % scale == 0 {
                return write!(f, "{}{unit}", b / scale);
            }
        }
        write!(f, "{b}B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_and_without_units() {
        let ok = [
            ("4096", 4096),
            ("64KiB", 65536),
            ("1MiB", 1 << 20),
            ("1.5GiB", 3 << 29),
            ("2kb", 2000),
            ("32k", 32000),
            ("32Ki", 32768),
            ("1 MB", 1_000_000),
        ];
        for (text, bytes) in ok {
            assert_eq!(text.parse::<ByteSize>(), Ok(ByteSize(bytes)), "{text}");
        }
        for bad in ["", "KiB", "12XB", "-1", "12 parsecs"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad}");
        }
        assert_eq!(ByteSize(65536).to_string(), "64KiB");
        assert_eq!(ByteSize(1000).to_string(), "1000B");
    }
}
