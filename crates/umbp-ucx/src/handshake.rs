//! The control connection's handshake: how a client gets a server's worker address and the
//! keys of the regions it exports.
//!
//! One exchange over a TCP socket, little-endian, every length bounded:
//!
//! ```text
//! client -> server   magic "UMBPUCX\0", version u32, token_len u32 (<= 4 KiB), token
//! server -> client   magic, version u32, verdict u8 (0 accepted, 1 bad token),
//!                    then, when accepted: address_len u32 (<= 64 KiB), worker address,
//!                    region_count u32 (<= 4096), and per region:
//!                    name_len u8, name (UTF-8), writable u8, base u64, len u64,
//!                    rkey_len u32 (<= 64 KiB), packed remote key
//! ```
//!
//! After it the socket stays open and silent: it is how each side learns that the other went
//! away (end of file), whatever the UCX transport notices.
//!
//! # What it trusts
//!
//! The server trusts whoever holds the token (or anyone who can connect, without one): it
//! hands them keys that let them read (and write, for writable regions) the exported regions.
//! Nothing is encrypted. On RDMA the NIC enforces that a key reaches only its region; over
//! TCP and shared memory UCX emulates the access in software, so the boundary is the network
//! and the engine's own checks (it never sends a request outside a region's exported bounds).
//! The client trusts the server's region list; a malformed one is a typed error.

use std::io::{Read, Write};

use crate::HandshakeError;

const MAGIC: [u8; 8] = *b"UMBPUCX\0";
/// The protocol version.
pub(crate) const VERSION: u32 = 1;
const MAX_TOKEN: u64 = 4096;
const MAX_ADDRESS: u64 = 64 << 10;
const MAX_REGIONS: u64 = 4096;
const MAX_RKEY: u64 = 64 << 10;

/// One exported region as the wire carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WireRegion {
    pub(crate) name: String,
    pub(crate) writable: bool,
    /// The region's address in the server's process.
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) rkey: Vec<u8>,
}

/// What the server tells an accepted client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub(crate) address: Vec<u8>,
    pub(crate) regions: Vec<WireRegion>,
}

/// Sends the client's hello.
pub(crate) fn send_hello(w: &mut impl Write, token: &[u8]) -> Result<(), HandshakeError> {
    let mut out = Vec::with_capacity(16 + token.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    put_bytes(&mut out, token);
    w.write_all(&out)?;
    Ok(w.flush()?)
}

/// Reads a client's hello and returns its token.
pub(crate) fn read_hello(r: &mut impl Read) -> Result<Vec<u8>, HandshakeError> {
    read_preamble(r)?;
    read_bytes(r, "token", MAX_TOKEN)
}

/// Sends the server's answer: the welcome, or a refusal when `welcome` is `None`.
pub(crate) fn send_welcome(
    w: &mut impl Write,
    welcome: Option<&Welcome>,
) -> Result<(), HandshakeError> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    match welcome {
        None => out.push(1),
        Some(welcome) => {
            out.push(0);
            put_bytes(&mut out, &welcome.address);
            out.extend_from_slice(&(welcome.regions.len() as u32).to_le_bytes());
            for region in &welcome.regions {
                let name = region.name.as_bytes();
                let name = &name[..name.len().min(255)];
                out.push(name.len() as u8);
                out.extend_from_slice(name);
                out.push(region.writable.into());
                out.extend_from_slice(&region.base.to_le_bytes());
                out.extend_from_slice(&region.len.to_le_bytes());
                put_bytes(&mut out, &region.rkey);
            }
        }
    }
    w.write_all(&out)?;
    Ok(w.flush()?)
}

/// Reads the server's answer.
pub(crate) fn read_welcome(r: &mut impl Read) -> Result<Welcome, HandshakeError> {
    read_preamble(r)?;
    match read_u8(r)? {
        0 => {}
        1 => return Err(HandshakeError::Refused("wrong token")),
        _ => return Err(HandshakeError::Malformed("unknown verdict")),
    }
    let address = read_bytes(r, "worker address", MAX_ADDRESS)?;
    let count = u64::from(read_u32(r)?);
    if count > MAX_REGIONS {
        return Err(HandshakeError::TooLong { field: "region list", len: count, max: MAX_REGIONS });
    }
    let mut regions = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let name_len = read_u8(r)?;
        let mut name = vec![0; name_len.into()];
        r.read_exact(&mut name)?;
        let name = String::from_utf8(name).map_err(|_| HandshakeError::Malformed("region name"))?;
        let writable = match read_u8(r)? {
            0 => false,
            1 => true,
            _ => return Err(HandshakeError::Malformed("region access")),
        };
        let base = read_u64(r)?;
        let len = read_u64(r)?;
        if base.checked_add(len).is_none() {
            return Err(HandshakeError::Malformed("a region wraps the address space"));
        }
        let rkey = read_bytes(r, "remote key", MAX_RKEY)?;
        regions.push(WireRegion { name, writable, base, len, rkey });
    }
    Ok(Welcome { address, regions })
}

/// Compares two tokens in time that depends only on their lengths.
pub(crate) fn tokens_match(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn read_preamble(r: &mut impl Read) -> Result<(), HandshakeError> {
    let mut magic = [0; 8];
    r.read_exact(&mut magic)?;
    if magic != MAGIC {
        return Err(HandshakeError::BadMagic);
    }
    let got = read_u32(r)?;
    if got != VERSION {
        return Err(HandshakeError::Version { got, expected: VERSION });
    }
    Ok(())
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn read_bytes(r: &mut impl Read, field: &'static str, max: u64) -> Result<Vec<u8>, HandshakeError> {
    let len = u64::from(read_u32(r)?);
    if len > max {
        return Err(HandshakeError::TooLong { field, len, max });
    }
    let mut bytes = vec![0; len as usize];
    r.read_exact(&mut bytes)?;
    Ok(bytes)
}

fn read_u8(r: &mut impl Read) -> Result<u8, HandshakeError> {
    let mut b = [0; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u32(r: &mut impl Read) -> Result<u32, HandshakeError> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> Result<u64, HandshakeError> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn welcome() -> Welcome {
        Welcome {
            address: vec![7; 300],
            regions: vec![
                WireRegion {
                    name: "arena".into(),
                    writable: true,
                    base: 0x7f00_0000,
                    len: 1 << 20,
                    rkey: vec![1, 2, 3],
                },
                WireRegion {
                    name: "ro".into(),
                    writable: false,
                    base: 0x1000,
                    len: 4096,
                    rkey: vec![9; 40],
                },
            ],
        }
    }

    #[test]
    fn hello_and_welcome_round_trip() {
        let mut wire = Vec::new();
        send_hello(&mut wire, b"secret").unwrap();
        assert_eq!(read_hello(&mut wire.as_slice()).unwrap(), b"secret");
        let mut wire = Vec::new();
        send_welcome(&mut wire, Some(&welcome())).unwrap();
        assert_eq!(read_welcome(&mut wire.as_slice()).unwrap(), welcome());
        let mut wire = Vec::new();
        send_welcome(&mut wire, None).unwrap();
        assert!(matches!(read_welcome(&mut wire.as_slice()), Err(HandshakeError::Refused(_))));
    }

    #[test]
    fn every_truncation_and_corruption_is_a_typed_error() {
        let mut wire = Vec::new();
        send_welcome(&mut wire, Some(&welcome())).unwrap();
        for cut in 0..wire.len() {
            let err = read_welcome(&mut &wire[..cut]).unwrap_err();
            assert!(matches!(err, HandshakeError::Io(_)), "cut at {cut}: {err:?}");
        }
        // Flip every byte in turn: each result is a welcome or a typed error, never a panic
        // and never an allocation past the limits.
        for i in 0..wire.len() {
            let mut bad = wire.clone();
            bad[i] ^= 0xff;
            let _ = read_welcome(&mut bad.as_slice());
        }
        let mut bad = wire.clone();
        bad[0] = b'X';
        assert!(matches!(read_welcome(&mut bad.as_slice()), Err(HandshakeError::BadMagic)));
        let mut bad = wire.clone();
        bad[8] = 9;
        assert!(matches!(
            read_welcome(&mut bad.as_slice()),
            Err(HandshakeError::Version { got: 9, .. })
        ));
        // A huge address length is refused before anything is allocated for it.
        let mut bad = wire[..13].to_vec();
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_welcome(&mut bad.as_slice()),
            Err(HandshakeError::TooLong { field: "worker address", .. })
        ));
    }

    #[test]
    fn a_region_that_wraps_the_address_space_is_malformed() {
        let mut w = welcome();
        w.regions[0].base = u64::MAX - 10;
        let mut wire = Vec::new();
        send_welcome(&mut wire, Some(&w)).unwrap();
        assert!(matches!(read_welcome(&mut wire.as_slice()), Err(HandshakeError::Malformed(_))));
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(tokens_match(b"abc", b"abc"));
        assert!(!tokens_match(b"abc", b"abd"));
        assert!(!tokens_match(b"abc", b"abcd"));
        assert!(tokens_match(b"", b""));
    }
}
