//! The session channel: keys derived from the handshake, and every message after it sealed.
//!
//! Once both sides proved the secret `K` (see [`crate::handshake`]), each derives two keys,
//! one per direction, with HKDF-SHA256:
//!
//! ```text
//! prk          = HKDF-Extract(salt = client nonce ‖ server nonce, ikm = K)
//! client key   = HKDF-Expand(prk, "umbp-ucx/3 client to server" ‖ SHA-256(transcript), 32)
//! server key   = HKDF-Expand(prk, "umbp-ucx/3 server to client" ‖ SHA-256(transcript), 32)
//! transcript   = hello ‖ challenge ‖ client proof      (every byte each side sent, as sent)
//! ```
//!
//! so the keys bind the secret, both nonces, both role labels, the protection chosen and
//! everything else the handshake exchanged: a relay that forwarded the handshake does not hold
//! them, and one that changed a byte of it leaves the two sides with different keys. (Without
//! a secret, `insecure_no_auth`, `K` is empty: the keys are anyone's, and the channel only
//! detects corruption.)
//!
//! Every message after the handshake is a *record*: its bytes and a 16-byte tag, sealed under
//! its direction's key and the direction's sequence number (0, 1, 2...), so a record
//! replayed, dropped, reordered, cut short, flipped in one bit or injected does not open, and
//! the side that reads it ends the connection.
//!
//! - [`Protection::Encrypted`] (confidentiality and integrity): AES-256-GCM, the sequence
//!   number as the nonce, the bytes enciphered.
//! - [`Protection::Authenticated`] (integrity only): the bytes travel as they are; the tag is
//!   the first 16 bytes of BLAKE3 in keyed mode over the bytes followed by the sequence number
//!   (8 bytes, little-endian; the record's length is the input's less 8, so no two records
//!   hash the same input), compared in constant time. (AES-GCM over an empty message with the
//!   bytes as associated data measured about 4× slower than encrypting on this project's x86
//!   machines, with ring, the AEAD this crate used first: its GHASH of associated data does
//!   not take the stitched AES-NI path; keyed BLAKE3 runs at several GiB/s there.) The
//!   sequence number comes *after* the bytes: before them it shifted every record off
//!   BLAKE3's 1 KiB chunk boundaries, and a record's first chunks were then hashed one at a
//!   time instead of eight at once with AVX2 (measured on one core of this project's machine,
//!   quiet: 1.1 against 2.4 GiB/s for a 4 KiB record, 4.2 against 6.0 GiB/s for 64 KiB, 5.4
//!   against 6.1 GiB/s for 256 KiB).
//!
//! Large payloads travel as records of at most [`CHUNK`] bytes, each opened before anything
//! relies on it. A record whose bytes must not change under the sender (a put's source, a
//! get's region) is sealed from where they are into the sender's own buffer
//! ([`Sealer::seal_into`]): one pass over them, where copying and then sealing in place made
//! two. The AEAD is aws-lc-rs's, which takes AVX-512 and VAES where the CPU has them.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use aws_lc_rs::hkdf;
use sha2::{Digest, Sha256};

/// Bytes of a record's tag.
pub(crate) const TAG: usize = 16;
/// The most payload bytes one record carries.
pub(crate) const CHUNK: usize = 256 << 10;

const CLIENT_TO_SERVER: &[u8] = b"umbp-ucx/3 client to server";
const SERVER_TO_CLIENT: &[u8] = b"umbp-ucx/3 server to client";

/// What the channel protects after the handshake. Both modes authenticate every message (a
/// relay, a replay or an injection is refused); a session is encrypted when either side asks
/// for it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protection {
    /// Integrity only: every message authenticated (a keyed BLAKE3 tag over its sequence
    /// number and bytes), its bytes readable by whoever sees the network.
    Authenticated,
    /// Confidentiality and integrity: every message enciphered and authenticated
    /// (AES-256-GCM). The default: with AES-NI and VAES it seals faster than
    /// [`Authenticated`](Self::Authenticated) hashes (see the crate README's figures).
    #[default]
    Encrypted,
}

impl Protection {
    pub(crate) fn wire(self) -> u8 {
        match self {
            Self::Encrypted => 0,
            Self::Authenticated => 1,
        }
    }

    pub(crate) fn from_wire(byte: u8) -> Option<Self> {
        match byte {
            0 => Some(Self::Encrypted),
            1 => Some(Self::Authenticated),
            _ => None,
        }
    }
}

/// A record did not open: forged, replayed, reordered, cut or corrupted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Forged;

/// The keys of one session, as one side holds them.
pub(crate) struct Keys {
    pub(crate) send: Sealer,
    pub(crate) recv: Opener,
}

impl std::fmt::Debug for Keys {
    /// Never the keys.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys").field("encrypted", &self.send.encrypts()).finish_non_exhaustive()
    }
}

/// Which side of the session the keys are for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

impl Keys {
    /// Derives the session's keys (see the module docs): `secret` (empty when insecure), the
    /// nonces, and the bytes of the whole handshake exchanged before the verdict.
    pub(crate) fn derive(
        side: Side,
        secret: &[u8],
        client_nonce: &[u8],
        server_nonce: &[u8],
        transcript: &[&[u8]],
        protection: Protection,
    ) -> Self {
        let mut hash = Sha256::new();
        for part in transcript {
            hash.update(part);
        }
        let transcript = hash.finalize();
        let mut salt = [0u8; 64];
        let n = client_nonce.len().min(32);
        salt[..n].copy_from_slice(&client_nonce[..n]);
        let m = server_nonce.len().min(32);
        salt[32..32 + m].copy_from_slice(&server_nonce[..m]);
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(secret);
        let key = |label: &[u8]| {
            let info = [label, transcript.as_slice()];
            let mut bytes = [0u8; 32];
            prk.expand(&info, KeyLen)
                .and_then(|okm| okm.fill(&mut bytes))
                .expect("32 bytes is within HKDF's limit");
            match protection {
                Protection::Encrypted => Key::Aead(Box::new(LessSafeKey::new(
                    UnboundKey::new(&AES_256_GCM, &bytes).expect("a 32-byte AES-256 key"),
                ))),
                Protection::Authenticated => Key::Mac(bytes),
            }
        };
        let (c2s, s2c) = (key(CLIENT_TO_SERVER), key(SERVER_TO_CLIENT));
        let (send, recv) = match side {
            Side::Client => (c2s, s2c),
            Side::Server => (s2c, c2s),
        };
        Self { send: Sealer { key: send, seq: 0 }, recv: Opener { key: recv, seq: 0 } }
    }
}

/// 32 bytes of HKDF output: an AES-256 key or a BLAKE3 key.
struct KeyLen;

impl hkdf::KeyType for KeyLen {
    fn len(&self) -> usize {
        32
    }
}

/// One direction's key.
enum Key {
    /// Encrypted: AES-256-GCM (boxed: its key schedule is large beside a BLAKE3 key).
    Aead(Box<LessSafeKey>),
    /// Authenticated only: a BLAKE3 key.
    Mac([u8; 32]),
}

impl Key {
    /// The MAC of record `seq`: keyed BLAKE3 over the bytes and then the sequence number, its
    /// first 16 bytes. (The bytes first, so they start on BLAKE3's chunk boundaries and are
    /// hashed with SIMD from the first chunk on; the module docs say what that saves.)
    fn mac(key: &[u8; 32], seq: u64, record: &[u8]) -> [u8; TAG] {
        let mut hasher = blake3::Hasher::new_keyed(key);
        hasher.update(record);
        hasher.update(&seq.to_le_bytes());
        let hash = hasher.finalize();
        hash.as_bytes()[..TAG].try_into().expect("16 of 32 bytes")
    }
}

/// Takes a direction's next sequence number (2^64 records are never sent on one connection).
fn next(seq: &mut u64) -> u64 {
    let this = *seq;
    *seq = seq.wrapping_add(1);
    this
}

/// Record `seq`'s AES-GCM nonce: the sequence number, big-endian, in the last 8 of 12 bytes.
fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals this side's records, in order.
pub(crate) struct Sealer {
    key: Key,
    seq: u64,
}

impl Sealer {
    /// Whether records are enciphered (else their bytes travel as they are).
    pub(crate) fn encrypts(&self) -> bool {
        matches!(self.key, Key::Aead(_))
    }

    /// Seals the next record in place (enciphered when encrypting, else unchanged) and
    /// returns its tag.
    pub(crate) fn seal(&mut self, record: &mut [u8]) -> [u8; TAG] {
        let seq = next(&mut self.seq);
        match &self.key {
            Key::Aead(key) => key
                .seal_in_place_separate_tag(nonce(seq), Aad::empty(), record)
                .expect("sealing fails only past GCM's length limit, far above a record's")
                .as_ref()
                .try_into()
                .expect("a 16-byte tag"),
            Key::Mac(key) => Key::mac(key, seq, record),
        }
    }

    /// Seals the next record from `plain` into `sealed` (as long), leaving `plain` as it is,
    /// and returns its tag: one pass over the bytes where a copy and then [`seal`](Self::seal)
    /// would make two. (When authenticating only, `sealed` is a copy of `plain`: use
    /// [`tag_of`](Self::tag_of) instead where the bytes can travel from where they are.)
    pub(crate) fn seal_into(&mut self, plain: &[u8], sealed: &mut [u8]) -> [u8; TAG] {
        let seq = next(&mut self.seq);
        match &self.key {
            Key::Aead(key) => {
                let mut tag = [0u8; TAG];
                key.seal_out_of_place_scatter(
                    nonce(seq),
                    Aad::empty(),
                    plain,
                    sealed,
                    &[],
                    &mut tag,
                )
                .expect("sealing fails only on unequal lengths or past GCM's limit");
                tag
            }
            Key::Mac(key) => {
                sealed.copy_from_slice(plain);
                Key::mac(key, seq, sealed)
            }
        }
    }

    /// When authenticating only: the tag of the next record, whose bytes travel as they are
    /// (so nothing is copied). `None` when encrypting: use [`seal_into`](Self::seal_into).
    pub(crate) fn tag_of(&mut self, record: &[u8]) -> Option<[u8; TAG]> {
        match &self.key {
            Key::Aead(_) => None,
            Key::Mac(key) => Some(Key::mac(key, next(&mut self.seq), record)),
        }
    }
}

/// Opens the other side's records, in order.
pub(crate) struct Opener {
    key: Key,
    seq: u64,
}

impl Opener {
    /// Opens the next record in place (deciphered when encrypted); `Err` when it is not the
    /// record the other side sealed next. After an error the record's bytes are garbage and
    /// the connection must end.
    pub(crate) fn open(&mut self, record: &mut [u8], tag: &[u8; TAG]) -> Result<(), Forged> {
        let seq = next(&mut self.seq);
        match &self.key {
            Key::Aead(key) => key
                .open_in_place_separate_tag(nonce(seq), Aad::empty(), tag, record)
                .map(|_| ())
                .map_err(|_| Forged),
            Key::Mac(key) => {
                let expected = Key::mac(key, seq, record);
                if constant_time_eq::constant_time_eq_16(&expected, tag) {
                    Ok(())
                } else {
                    Err(Forged)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(protection: Protection, secret: &[u8], transcript: &[u8]) -> (Keys, Keys) {
        let derive =
            |side, t: &[u8]| Keys::derive(side, secret, &[1; 32], &[2; 32], &[t], protection);
        (derive(Side::Client, transcript), derive(Side::Server, transcript))
    }

    #[test]
    fn records_open_in_order_and_nothing_else_opens() {
        for protection in [Protection::Encrypted, Protection::Authenticated] {
            let (mut client, mut server) = pair(protection, b"0123456789abcdef", b"hello");
            let plain = b"a request of 32 bytes, give or t".to_vec();
            let mut first = plain.clone();
            let tag = client.send.seal(&mut first);
            assert_eq!(first != plain, protection == Protection::Encrypted, "{protection:?}");
            let mut second = plain.clone();
            let tag2 = client.send.seal(&mut second);
            // Out of order: the second record where the first is due.
            let mut copy = second.clone();
            assert_eq!(
                server.recv.try_at_same_point(protection).open(&mut copy, &tag2),
                Err(Forged)
            );
            // One flipped bit anywhere, in the bytes or the tag.
            for bit in 0..(first.len() + TAG) * 8 {
                let (mut bytes, mut t) = (first.clone(), tag);
                if bit / 8 < bytes.len() {
                    bytes[bit / 8] ^= 1 << (bit % 8);
                } else {
                    t[bit / 8 - bytes.len()] ^= 1 << (bit % 8);
                }
                assert_eq!(
                    server.recv.try_at_same_point(protection).open(&mut bytes, &t),
                    Err(Forged)
                );
            }
            // The right order opens, and the same record again (a replay) does not.
            let mut bytes = first.clone();
            server.recv.open(&mut bytes, &tag).unwrap();
            assert_eq!(bytes, plain);
            let mut again = first.clone();
            assert_eq!(
                server.recv.try_at_same_point(protection).open(&mut again, &tag),
                Err(Forged)
            );
            server.recv.open(&mut second, &tag2).unwrap();
            assert_eq!(second, plain);
            // The client's own key does not open what it sent back to it (reflection).
            let mut bytes = plain.clone();
            let tag = client.send.seal(&mut bytes);
            assert_eq!(client.recv.open(&mut bytes, &tag), Err(Forged));
        }
    }

    #[test]
    fn sealing_into_another_buffer_is_copying_then_sealing_in_place() {
        for protection in [Protection::Encrypted, Protection::Authenticated] {
            let (mut client, mut server) = pair(protection, b"0123456789abcdef", b"hello");
            let (mut twin, _) = pair(protection, b"0123456789abcdef", b"hello");
            // Past one 64 KiB block and not a multiple of AES's 16 bytes; then a short record.
            let plain: Vec<u8> = (0..70_001u32).map(|i| (i * 7 + i / 256) as u8).collect();
            for len in [plain.len(), 100] {
                let plain = &plain[..len];
                let mut sealed = vec![0u8; len];
                let tag = client.send.seal_into(plain, &mut sealed);
                let mut in_place = plain.to_vec();
                let twin_tag = twin.send.seal(&mut in_place);
                assert_eq!((&sealed, tag), (&in_place, twin_tag), "{protection:?}, {len} bytes");
                assert_eq!(sealed != plain, protection == Protection::Encrypted);
                server.recv.open(&mut sealed, &tag).unwrap();
                assert_eq!(sealed, plain);
            }
        }
    }

    #[test]
    fn keys_bind_the_secret_the_transcript_and_the_protection() {
        let (mut client, _) = pair(Protection::Encrypted, b"0123456789abcdef", b"hello");
        let mut record = vec![7u8; 100];
        let tag = client.send.seal(&mut record);
        for (secret, transcript, protection) in [
            (&b"0123456789abcdeF"[..], &b"hello"[..], Protection::Encrypted),
            (b"0123456789abcdef", b"hellO", Protection::Encrypted),
            (b"0123456789abcdef", b"hello", Protection::Authenticated),
        ] {
            let (_, mut server) = pair(protection, secret, transcript);
            let mut copy = record.clone();
            assert_eq!(server.recv.open(&mut copy, &tag), Err(Forged));
        }
        let (_, mut server) = pair(Protection::Encrypted, b"0123456789abcdef", b"hello");
        server.recv.open(&mut record, &tag).unwrap();
        assert_eq!(record, vec![7u8; 100]);
    }

    impl Opener {
        /// The server's opener of the tests' usual pair for `protection` at this one's point,
        /// so a test can try a record without using up this opener's turn.
        fn try_at_same_point(&self, protection: Protection) -> Opener {
            let (_, server) = pair(protection, b"0123456789abcdef", b"hello");
            Opener { seq: self.seq, ..server.recv }
        }
    }
}
