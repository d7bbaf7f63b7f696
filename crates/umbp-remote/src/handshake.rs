//! The control connection's handshake: mutual authentication, then what the server exports.
//!
//! Four messages over a TCP socket, little-endian, every field of fixed size or bounded:
//!
//! ```text
//! client -> server   hello      magic "UMBPUCX\0", version u32, client nonce [32],
//!                               protection u8 (what the client asks for: 0 encrypted,
//!                               1 authenticated)
//! server -> client   challenge  magic, version u32, auth u8 (0 keyed, 1 insecure: no secret),
//!                               server nonce [32], server proof [32], protection u8 (the
//!                               session's: encrypted when either side asks for it)
//! client -> server   proof      client proof [32]
//! server -> client   verdict    u8 (0 accepted, 1 wrong proof, 2 server full), then when
//!                               accepted, as two sealed records (see [`crate::channel`]):
//!                               welcome_len u32 (<= 16 MiB), then the welcome:
//!                               mode u8 (0 checked, 1 one-sided),
//!                               node u8 (0 none, 1 named), [named: node id u32],
//!                               [one-sided: address_len u32 (16 ..= 64 KiB), worker address],
//!                               region_count u32 (<= 4096), and per region: name_len u8,
//!                               name (UTF-8), writable u8, len u64,
//!                               [one-sided: base u64, rkey_len u32 (<= 64 KiB), packed key]
//! ```
//!
//! # Authentication
//!
//! Both sides hold a shared secret `K` (at least [`MIN_SECRET`] bytes); neither sends it. Each
//! proves knowledge of it with `HMAC-SHA256(K, role label ‖ client nonce ‖ server nonce)`:
//! the server with the label [`SERVER_LABEL`], the client with [`CLIENT_LABEL`]. Both nonces
//! are fresh random bytes, so a recorded proof is worthless for another connection (replay),
//! and the labels differ, so a server's proof sent back to it is not a client's (reflection).
//! Proofs are compared in constant time. The client checks the server's proof *before* it
//! reads anything else the server says, so nothing from a server that does not hold the
//! secret reaches UCX (or anything but this parser).
//!
//! A server started insecure says so (`auth` 1) and a client connects to it only when it was
//! configured insecure too; a client that expects authentication refuses it.
//!
//! Both sides then derive the session's keys from the secret, both nonces and every byte of
//! the handshake so far ([`crate::channel`]); the welcome and everything after it travel as
//! sealed records, so a relay that forwarded the handshake cannot read or write the session.
//! A client refuses a session weaker than it asked for (the challenge's protection byte is
//! bound into the keys too, so a relay cannot change it unnoticed).
//!
//! # The node's identity
//!
//! A server that serves as a pool's memory node names its node id in the welcome. The welcome
//! is a sealed record under keys derived from the whole handshake, so the name is bound to
//! this session: a relay cannot change it, and no other session's welcome opens here. A
//! client that dials a node it found in an index ([`RemoteEngine::connect_node`]) refuses a
//! server that names another node, or none, before it uses anything the server offers: an
//! index entry that points one node's id at another node's address (whoever can write the
//! index can do that) reaches a refusal, never the other node's memory.
//!
//! [`RemoteEngine::connect_node`]: crate::RemoteEngine::connect_node
//!
//! After the verdict, in checked mode, the same connection carries the data requests
//! ([`crate::checked`]); in one-sided mode it stays silent and tells each side, by closing,
//! that the other went away.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::channel::{Keys, Protection, Side, TAG};
use crate::HandshakeError;

const MAGIC: [u8; 8] = *b"UMBPUCX\0";
/// The protocol version: 5 since the welcome names the server's node (4 had no such field, and
/// a client of 5 must not mistake a server of 4 for one that names none on purpose); 4 since an
/// authenticated-only record's tag hashes its sequence number after its bytes (3 hashed it
/// before them). A node and a client of two versions refuse each other at the handshake.
pub(crate) const VERSION: u32 = 5;
/// Bytes of each nonce.
pub(crate) const NONCE: usize = 32;
/// Bytes of each proof (an HMAC-SHA256).
pub(crate) const PROOF: usize = 32;
/// The shortest secret accepted.
pub const MIN_SECRET: usize = 16;
/// The longest secret accepted.
pub const MAX_SECRET: usize = 4096;
/// What the server's proof covers besides the nonces.
pub(crate) const SERVER_LABEL: &[u8] = b"umbp-ucx/3 server proof";
/// What the client's proof covers besides the nonces.
pub(crate) const CLIENT_LABEL: &[u8] = b"umbp-ucx/3 client proof";
/// Bytes of the hello.
pub(crate) const HELLO_LEN: usize = 8 + 4 + NONCE + 1;
/// Bytes of the challenge.
pub(crate) const CHALLENGE_LEN: usize = 8 + 4 + 1 + NONCE + PROOF + 1;
/// The longest welcome accepted.
const MAX_WELCOME: u64 = 16 << 20;
const MIN_ADDRESS: u64 = 16;
const MAX_ADDRESS: u64 = 64 << 10;
const MAX_REGIONS: u64 = 4096;
const MAX_RKEY: u64 = 64 << 10;

/// How the server reaches its exported memory for a client.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every read and write is a request on the control connection that the server checks
    /// (region, offset, length, writable) before it touches memory. No UCX on the path.
    Checked,
    /// One-sided UCX operations with the regions' remote keys, enforced by RDMA hardware.
    OneSided,
}

/// One exported region as the wire carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WireRegion {
    pub(crate) name: String,
    pub(crate) writable: bool,
    pub(crate) len: u64,
    /// One-sided mode: the region's address in the server's process, and its packed key.
    pub(crate) one_sided: Option<(u64, Vec<u8>)>,
}

/// What the server tells an authenticated client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Welcome {
    /// One-sided mode: the server's UCX worker address.
    pub(crate) address: Option<Vec<u8>>,
    /// The node the server serves as (its node id in a pool), when it names one.
    pub(crate) node: Option<u32>,
    pub(crate) regions: Vec<WireRegion>,
}

impl Welcome {
    pub(crate) fn mode(&self) -> Mode {
        if self.address.is_some() {
            Mode::OneSided
        } else {
            Mode::Checked
        }
    }
}

/// The shared secret, or the explicit choice to run without one.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Auth<'a> {
    Keyed(&'a [u8]),
    Insecure,
}

/// The server's answer to a proof.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Written in the clear only by the tests; the wire seals the welcome ([`sealed_welcome`]).
    #[cfg_attr(not(test), allow(dead_code))]
    Accepted,
    WrongProof,
    Full,
}

/// Fresh random bytes for a nonce.
pub(crate) fn nonce() -> Result<[u8; NONCE], HandshakeError> {
    let mut n = [0; NONCE];
    getrandom::fill(&mut n).map_err(|_| HandshakeError::Malformed("no system randomness"))?;
    Ok(n)
}

/// `HMAC-SHA256(secret, label ‖ client nonce ‖ server nonce)`.
pub(crate) fn proof(
    secret: &[u8],
    label: &[u8],
    client: &[u8; NONCE],
    server: &[u8; NONCE],
) -> [u8; PROOF] {
    proof_mac(secret, label, client, server).finalize().into_bytes().into()
}

fn proof_mac(
    secret: &[u8],
    label: &[u8],
    client: &[u8; NONCE],
    server: &[u8; NONCE],
) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key");
    mac.update(label);
    mac.update(client);
    mac.update(server);
    mac
}

/// Whether `got` is the proof of `label` over the nonces, compared in constant time.
pub(crate) fn verify(
    secret: &[u8],
    label: &[u8],
    client: &[u8; NONCE],
    server: &[u8; NONCE],
    got: &[u8; PROOF],
) -> bool {
    proof_mac(secret, label, client, server).verify_slice(got).is_ok()
}

/// The client's hello, asking for `protection`.
pub(crate) fn hello(client_nonce: &[u8; NONCE], protection: Protection) -> [u8; HELLO_LEN] {
    let mut out = [0; HELLO_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..12 + NONCE].copy_from_slice(client_nonce);
    out[12 + NONCE] = protection.wire();
    out
}

/// Parses a hello: the client's nonce and the protection it asks for.
pub(crate) fn parse_hello(
    bytes: &[u8; HELLO_LEN],
) -> Result<([u8; NONCE], Protection), HandshakeError> {
    check_preamble(&bytes[..12])?;
    let protection = Protection::from_wire(bytes[12 + NONCE])
        .ok_or(HandshakeError::Malformed("unknown protection"))?;
    Ok((bytes[12..12 + NONCE].try_into().expect("32 bytes"), protection))
}

/// The server's challenge: its nonce, its proof (zeros when insecure) and the session's
/// protection.
pub(crate) fn challenge(
    auth: Auth<'_>,
    client_nonce: &[u8; NONCE],
    server_nonce: &[u8; NONCE],
    protection: Protection,
) -> [u8; CHALLENGE_LEN] {
    let mut out = [0; CHALLENGE_LEN];
    out[..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[13..13 + NONCE].copy_from_slice(server_nonce);
    match auth {
        Auth::Keyed(secret) => {
            let p = proof(secret, SERVER_LABEL, client_nonce, server_nonce);
            out[13 + NONCE..13 + NONCE + PROOF].copy_from_slice(&p);
        }
        Auth::Insecure => out[12] = 1,
    }
    out[CHALLENGE_LEN - 1] = protection.wire();
    out
}

/// The session's keys on `side`, from the handshake's bytes as sent: hello, challenge, proof.
pub(crate) fn session_keys(
    side: Side,
    auth: Auth<'_>,
    hello: &[u8; HELLO_LEN],
    challenge: &[u8; CHALLENGE_LEN],
    proof: &[u8; PROOF],
) -> Keys {
    let secret = match auth {
        Auth::Keyed(secret) => secret,
        Auth::Insecure => &[],
    };
    let protection =
        Protection::from_wire(challenge[CHALLENGE_LEN - 1]).unwrap_or(Protection::Encrypted);
    Keys::derive(
        side,
        secret,
        &hello[12..12 + NONCE],
        &challenge[13..13 + NONCE],
        &[hello, challenge, proof],
        protection,
    )
}

/// What the server sends an accepted client after its proof: the verdict byte, then the
/// welcome's length and the welcome as two sealed records.
pub(crate) fn sealed_welcome(keys: &mut Keys, welcome: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 4 + welcome.len() + 2 * TAG);
    out.push(0);
    let mut len = (welcome.len() as u32).to_le_bytes();
    let tag = keys.send.seal(&mut len);
    out.extend_from_slice(&len);
    out.extend_from_slice(&tag);
    let at = out.len();
    out.extend_from_slice(welcome);
    let tag = keys.send.seal(&mut out[at..]);
    out.extend_from_slice(&tag);
    out
}

/// The client's side of the handshake, from hello to verdict: proves the secret, checks the
/// server's proof before anything else it sends, and returns the server's welcome (opened
/// with the session's keys) and the keys.
pub(crate) fn client(
    stream: &mut (impl Read + Write),
    auth: Auth<'_>,
    protection: Protection,
) -> Result<(Welcome, Keys), HandshakeError> {
    let client_nonce = nonce()?;
    let hello = hello(&client_nonce, protection);
    stream.write_all(&hello)?;
    stream.flush()?;
    let mut challenge = [0; CHALLENGE_LEN];
    stream.read_exact(&mut challenge)?;
    check_preamble(&challenge[..12])?;
    let server_nonce: [u8; NONCE] = challenge[13..13 + NONCE].try_into().expect("32 bytes");
    let server_proof: [u8; PROOF] =
        challenge[13 + NONCE..13 + NONCE + PROOF].try_into().expect("32 bytes");
    let offered = Protection::from_wire(challenge[CHALLENGE_LEN - 1])
        .ok_or(HandshakeError::Malformed("unknown protection"))?;
    let answer = match (challenge[12], auth) {
        (0, Auth::Keyed(secret)) => {
            if !verify(secret, SERVER_LABEL, &client_nonce, &server_nonce, &server_proof) {
                return Err(HandshakeError::ServerNotAuthenticated);
            }
            proof(secret, CLIENT_LABEL, &client_nonce, &server_nonce)
        }
        (0, Auth::Insecure) => {
            return Err(HandshakeError::Refused("the server requires a secret; none is set"))
        }
        (1, Auth::Keyed(_)) => return Err(HandshakeError::ServerInsecure),
        (1, Auth::Insecure) => [0; PROOF],
        _ => return Err(HandshakeError::Malformed("unknown authentication")),
    };
    if offered < protection {
        return Err(HandshakeError::Refused(
            "the server offered a session with less protection than this side asks for",
        ));
    }
    stream.write_all(&answer)?;
    stream.flush()?;
    let mut keys = session_keys(Side::Client, auth, &hello, &challenge, &answer);
    read_verdict_byte(stream)?;
    // The welcome, sealed: its length, then its bytes.
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let tag = read_tag(stream)?;
    keys.recv.open(&mut len, &tag).map_err(|_| HandshakeError::Forged)?;
    let len = u64::from(u32::from_le_bytes(len));
    if len > MAX_WELCOME {
        return Err(HandshakeError::TooLong { field: "welcome", len, max: MAX_WELCOME });
    }
    let mut body = vec![0; len as usize];
    stream.read_exact(&mut body)?;
    let tag = read_tag(stream)?;
    keys.recv.open(&mut body, &tag).map_err(|_| HandshakeError::Forged)?;
    let mut rest = body.as_slice();
    let welcome = parse_welcome(&mut rest)?;
    if !rest.is_empty() {
        return Err(HandshakeError::Malformed("bytes past the welcome"));
    }
    Ok((welcome, keys))
}

fn read_tag(r: &mut impl Read) -> Result<[u8; TAG], HandshakeError> {
    let mut tag = [0u8; TAG];
    r.read_exact(&mut tag)?;
    Ok(tag)
}

/// Reads the verdict byte: `Ok` when accepted.
fn read_verdict_byte(r: &mut impl Read) -> Result<(), HandshakeError> {
    match read_u8(r)? {
        0 => Ok(()),
        1 => Err(HandshakeError::Refused(
            "authentication failed (wrong or missing secret on this side or the server's): \
             the server did not accept this side's proof",
        )),
        2 => Err(HandshakeError::Refused("the server serves as many clients as it may")),
        _ => Err(HandshakeError::Malformed("unknown verdict")),
    }
}

/// Reads the verdict and, when accepted, a welcome in the clear (as [`verdict`] writes it).
#[cfg(test)]
fn read_verdict(r: &mut impl Read) -> Result<Welcome, HandshakeError> {
    read_verdict_byte(r)?;
    parse_welcome(r)
}

/// Parses a welcome.
fn parse_welcome(r: &mut impl Read) -> Result<Welcome, HandshakeError> {
    let one_sided = match read_u8(r)? {
        0 => false,
        1 => true,
        _ => return Err(HandshakeError::Malformed("unknown mode")),
    };
    let node = match read_u8(r)? {
        0 => None,
        1 => Some(read_u32(r)?),
        _ => return Err(HandshakeError::Malformed("unknown node field")),
    };
    let address = if one_sided {
        let address = read_bytes(r, "worker address", MAX_ADDRESS)?;
        if (address.len() as u64) < MIN_ADDRESS {
            return Err(HandshakeError::Malformed("a worker address shorter than any UCX's"));
        }
        Some(address)
    } else {
        None
    };
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
        let len = read_u64(r)?;
        let one_sided = if one_sided {
            let base = read_u64(r)?;
            if base.checked_add(len).is_none() {
                return Err(HandshakeError::Malformed("a region wraps the address space"));
            }
            let rkey = read_bytes(r, "remote key", MAX_RKEY)?;
            if rkey.is_empty() {
                return Err(HandshakeError::Malformed("an empty remote key"));
            }
            Some((base, rkey))
        } else {
            None
        };
        regions.push(WireRegion { name, writable, len, one_sided });
    }
    Ok(Welcome { address, node, regions })
}

/// The server's verdict, and the welcome in the clear when accepted (the wire seals it:
/// [`sealed_welcome`]).
pub(crate) fn verdict(verdict: Verdict, welcome: &Welcome) -> Vec<u8> {
    match verdict {
        Verdict::Accepted => {
            let mut out = vec![0];
            out.extend_from_slice(&welcome_bytes(welcome));
            out
        }
        Verdict::WrongProof => vec![1],
        Verdict::Full => vec![2],
    }
}

/// A welcome's bytes.
pub(crate) fn welcome_bytes(welcome: &Welcome) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(u8::from(welcome.address.is_some()));
    match welcome.node {
        None => out.push(0),
        Some(node) => {
            out.push(1);
            out.extend_from_slice(&node.to_le_bytes());
        }
    }
    if let Some(address) = &welcome.address {
        put_bytes(&mut out, address);
    }
    out.extend_from_slice(&(welcome.regions.len() as u32).to_le_bytes());
    for region in &welcome.regions {
        let name = region.name.as_bytes();
        let name = &name[..name.len().min(255)];
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.push(region.writable.into());
        out.extend_from_slice(&region.len.to_le_bytes());
        if let Some((base, rkey)) = &region.one_sided {
            out.extend_from_slice(&base.to_le_bytes());
            put_bytes(&mut out, rkey);
        }
    }
    out
}

fn check_preamble(bytes: &[u8]) -> Result<(), HandshakeError> {
    if bytes[..8] != MAGIC {
        return Err(HandshakeError::BadMagic);
    }
    let got = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
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

    fn welcome(one_sided: bool) -> Welcome {
        let key = |k: Vec<u8>, base| one_sided.then_some((base, k));
        Welcome {
            address: one_sided.then(|| vec![7; 300]),
            node: one_sided.then_some(7),
            regions: vec![
                WireRegion {
                    name: "arena".into(),
                    writable: true,
                    len: 1 << 20,
                    one_sided: key(vec![1, 2, 3], 0x7f00_0000),
                },
                WireRegion {
                    name: "ro".into(),
                    writable: false,
                    len: 4096,
                    one_sided: key(vec![9; 40], 0x1000),
                },
            ],
        }
    }

    /// A server's side run against a scripted peer: `after_proof` is what it answers once it
    /// has read the client's proof: a verdict in the clear, whose welcome (if any) it seals
    /// with the session's keys, unless `raw`.
    struct Script {
        input: Vec<u8>,
        output: std::io::Cursor<Vec<u8>>,
        secret: Option<Vec<u8>>,
        server_nonce: [u8; NONCE],
        after_proof: Vec<u8>,
        raw: bool,
        challenge: [u8; CHALLENGE_LEN],
        sent_proof: Option<[u8; PROOF]>,
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.output.read(buf)
        }
    }

    impl Write for Script {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.input.extend_from_slice(buf);
            let auth = self.secret.as_deref().map_or(Auth::Insecure, Auth::Keyed);
            if self.input.len() == HELLO_LEN {
                let hello: [u8; HELLO_LEN] = self.input[..].try_into().unwrap();
                let (cn, asked) = parse_hello(&hello).unwrap();
                self.challenge = challenge(auth, &cn, &self.server_nonce, asked);
                self.output = std::io::Cursor::new(self.challenge.to_vec());
            } else if self.input.len() == HELLO_LEN + PROOF {
                let proof: [u8; PROOF] = self.input[HELLO_LEN..].try_into().unwrap();
                self.sent_proof = Some(proof);
                let hello: [u8; HELLO_LEN] = self.input[..HELLO_LEN].try_into().unwrap();
                let out = if self.raw || self.after_proof[0] != 0 {
                    self.after_proof.clone()
                } else {
                    let mut keys =
                        session_keys(Side::Server, auth, &hello, &self.challenge, &proof);
                    sealed_welcome(&mut keys, &self.after_proof[1..])
                };
                self.output = std::io::Cursor::new(out);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn script(secret: Option<&[u8]>, after_proof: Vec<u8>) -> Script {
        Script {
            input: Vec::new(),
            output: std::io::Cursor::new(Vec::new()),
            secret: secret.map(<[u8]>::to_vec),
            server_nonce: [3; NONCE],
            after_proof,
            raw: false,
            challenge: [0; CHALLENGE_LEN],
            sent_proof: None,
        }
    }

    const SECRET: &[u8] = b"0123456789abcdef-shared";

    #[test]
    fn both_sides_prove_the_secret_and_the_welcome_round_trips() {
        for one_sided in [false, true] {
            let w = welcome(one_sided);
            let mut s = script(Some(SECRET), verdict(Verdict::Accepted, &w));
            assert_eq!(client(&mut s, Auth::Keyed(SECRET), Protection::Encrypted).unwrap().0, w);
            // The client's proof is the keyed hash of its label over both nonces.
            let cn: [u8; NONCE] = s.input[12..12 + NONCE].try_into().unwrap();
            let sent = s.sent_proof.unwrap();
            assert!(verify(SECRET, CLIENT_LABEL, &cn, &[3; NONCE], &sent));
            // Not the server's proof reflected, not valid under another secret.
            assert!(!verify(SECRET, SERVER_LABEL, &cn, &[3; NONCE], &sent));
            assert!(!verify(b"another secret, 16+", CLIENT_LABEL, &cn, &[3; NONCE], &sent));
            // The secret is nowhere in what the client sent.
            assert!(!s.input.windows(SECRET.len()).any(|w| w == SECRET));
        }
    }

    #[test]
    fn a_server_without_the_secret_is_refused_before_its_welcome_is_read() {
        // The welcome would be garbage that reaches UCX; the client never reads it.
        let mut s = script(Some(b"not the right secret!"), vec![0, 1, 0xff, 0xff, 0xff, 0xff]);
        s.raw = true;
        let err = client(&mut s, Auth::Keyed(SECRET), Protection::Encrypted).unwrap_err();
        assert!(matches!(err, HandshakeError::ServerNotAuthenticated), "{err:?}");
        assert!(s.sent_proof.is_none(), "the client answered an unauthenticated server");
        // A server that runs insecure is refused by a client that expects a secret.
        let mut s = script(None, verdict(Verdict::Accepted, &welcome(false)));
        let err = client(&mut s, Auth::Keyed(SECRET), Protection::Encrypted).unwrap_err();
        assert!(matches!(err, HandshakeError::ServerInsecure), "{err:?}");
        // Both insecure: accepted.
        let mut s = script(None, verdict(Verdict::Accepted, &welcome(false)));
        assert_eq!(
            client(&mut s, Auth::Insecure, Protection::Encrypted).unwrap().0,
            welcome(false)
        );
        // A welcome that a relay sends in the clear (it holds no keys) does not open.
        let mut s = script(Some(SECRET), verdict(Verdict::Accepted, &welcome(false)));
        s.raw = true;
        let err = client(&mut s, Auth::Keyed(SECRET), Protection::Encrypted).unwrap_err();
        assert!(matches!(err, HandshakeError::Forged), "{err:?}");
    }

    #[test]
    fn every_truncation_and_corruption_of_the_welcome_is_a_typed_error() {
        for one_sided in [false, true] {
            let wire = verdict(Verdict::Accepted, &welcome(one_sided));
            for cut in 0..wire.len() {
                let err = read_verdict(&mut &wire[..cut]).unwrap_err();
                assert!(matches!(err, HandshakeError::Io(_)), "cut at {cut}: {err:?}");
            }
            // Flip every byte in turn: each result is a welcome or a typed error, never a
            // panic and never an allocation past the limits.
            for i in 0..wire.len() {
                let mut bad = wire.clone();
                bad[i] ^= 0xff;
                let _ = read_verdict(&mut bad.as_slice());
            }
        }
        let wire = verdict(Verdict::Accepted, &welcome(true));
        // A huge address length is refused before anything is allocated for it (after the
        // verdict, the mode and the node field: 1 + 1 + 5 bytes).
        let mut bad = wire[..7].to_vec();
        bad.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_verdict(&mut bad.as_slice()),
            Err(HandshakeError::TooLong { field: "worker address", .. })
        ));
        // So is a worker address too short to be one.
        let mut bad = wire[..7].to_vec();
        bad.extend_from_slice(&3u32.to_le_bytes());
        bad.extend_from_slice(&[1, 2, 3, 0, 0, 0, 0]);
        assert!(matches!(read_verdict(&mut bad.as_slice()), Err(HandshakeError::Malformed(_))));
        assert!(matches!(read_verdict(&mut [1u8].as_slice()), Err(HandshakeError::Refused(_))));
        assert!(matches!(read_verdict(&mut [2u8].as_slice()), Err(HandshakeError::Refused(_))));
    }

    #[test]
    fn a_region_that_wraps_the_address_space_is_malformed() {
        let mut w = welcome(true);
        w.regions[0].one_sided = Some((u64::MAX - 10, vec![1]));
        let wire = verdict(Verdict::Accepted, &w);
        assert!(matches!(read_verdict(&mut wire.as_slice()), Err(HandshakeError::Malformed(_))));
    }

    #[test]
    fn a_bad_preamble_is_typed() {
        let mut h = hello(&[1; NONCE], Protection::Authenticated);
        assert_eq!(parse_hello(&h).unwrap(), ([1; NONCE], Protection::Authenticated));
        h[0] = b'X';
        assert!(matches!(parse_hello(&h), Err(HandshakeError::BadMagic)));
        let mut h = hello(&[1; NONCE], Protection::Encrypted);
        h[HELLO_LEN - 1] = 7;
        assert!(matches!(parse_hello(&h), Err(HandshakeError::Malformed(_))));
        let mut h = hello(&[1; NONCE], Protection::Encrypted);
        h[8] = 9;
        assert!(matches!(parse_hello(&h), Err(HandshakeError::Version { got: 9, .. })));
    }
}
