//! Block keys: any 16 bytes (vLLM's block hashes, or any 128-bit key).

use std::fmt;

/// The key of one KV block: 16 bytes, compared bytewise. vLLM's block hashes, a truncated
/// SHA-256 of a token prefix, or any 128-bit value.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockKey(pub [u8; 16]);

impl BlockKey {
    /// The key whose bytes are `value` in big-endian order.
    pub const fn from_u128(value: u128) -> Self {
        Self(value.to_be_bytes())
    }

    /// The key as a big-endian integer.
    pub const fn as_u128(&self) -> u128 {
        u128::from_be_bytes(self.0)
    }

    /// The key's 16 bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The key from exactly 16 bytes; `None` for any other length.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 16]>::try_from(bytes).ok().map(Self)
    }
}

impl From<[u8; 16]> for BlockKey {
    fn from(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }
}

impl From<u128> for BlockKey {
    fn from(value: u128) -> Self {
        Self::from_u128(value)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

/// 32 lowercase hex digits.
impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.as_u128())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_prints_hex() {
        let k = BlockKey::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        assert_eq!(k.0[0], 1);
        assert_eq!(k.0[15], 0x10);
        assert_eq!(k.as_u128(), 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        assert_eq!(k.to_string(), "0102030405060708090a0b0c0d0e0f10");
        assert_eq!(BlockKey::from_slice(&k.0), Some(k));
        assert_eq!(BlockKey::from_slice(&[0; 15]), None);
    }
}
