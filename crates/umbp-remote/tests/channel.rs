//! The channel after the handshake, attacked on the wire: a relay that forwarded the handshake
//! cannot use the session; a session replayed, reordered, cut short, injected into or with one
//! bit flipped in any request or answer is refused, its connection closed, and nothing forged
//! lands; clients that vanish lose their slots; a connect flood keeps no honest client out.
//! Everything on loopback (127.0.0.1).

mod support;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp_plan::{EndpointRegistry, Fragment, PlanBuilder, Register, Tag, TransferEngine};
use umbp_remote::{
    internal, Error, HandshakeError, Protection, RemoteConfig, RemoteEngine, ServerBuilder,
};

use support::{config, fill_byte, ucx_or_skip, POISON, SECRET};

const ARENA: usize = 1 << 20;
const PIECE: usize = 64 << 10;
/// The handshake's bytes up (hello, proof) and down (challenge, verdict, the sealed welcome's
/// length and the sealed welcome of one region named `arena`, naming no node).
const UP_HANDSHAKE: usize = 45 + 32;
const DOWN_HANDSHAKE: usize = 78 + 1 + (4 + 16) + (21 + 16);
/// A sealed request, a sealed answer, and a piece's bytes sealed as one record.
const REQ: usize = 32 + 16;
const ANS: usize = 24 + 16;
const DATA: usize = PIECE + 16;
/// Where the put lands in the arena.
const PUT_AT: usize = 512 << 10;

fn arena_byte(i: usize) -> u8 {
    fill_byte(7, i)
}

fn outgoing_byte(i: usize) -> u8 {
    (i as u8).wrapping_mul(13) ^ 0xC3
}

/// Bytes a relay saw one way.
type Log = Arc<Mutex<Vec<u8>>>;

/// What a relay does to one direction's bytes after the handshake: once `need` of them have
/// arrived, `edit` rewrites them and says whether to keep the connection open (else the relay
/// closes both sides); what follows passes through.
struct Tamper {
    need: usize,
    edit: Edit,
}

/// Rewrites the bytes held; whether to keep the connection open.
type Edit = Box<dyn FnOnce(&mut Vec<u8>) -> bool + Send>;

/// A tampering: what it does, upward (client to server) or not, the tampering, the objects
/// that must fail, and whether the put may land (`Some(false)`: it must not).
type Case = (&'static str, bool, Tamper, Vec<u32>, Option<bool>);

fn flip(need: usize, at: usize) -> Tamper {
    Tamper {
        need,
        edit: Box::new(move |b| {
            b[at] ^= 0x10;
            true
        }),
    }
}

fn edit(need: usize, f: impl FnOnce(&mut Vec<u8>) + Send + 'static) -> Tamper {
    Tamper {
        need,
        edit: Box::new(move |b| {
            f(b);
            true
        }),
    }
}

fn cut(need: usize, at: usize) -> Tamper {
    Tamper {
        need,
        edit: Box::new(move |b| {
            b.truncate(at);
            false
        }),
    }
}

/// Forwards `from` to `to`: the first `handshake` bytes as they are, then the rest through
/// `tamper`, logging all of it.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    handshake: usize,
    tamper: Option<Tamper>,
    log: Log,
) {
    let mut buf = vec![0u8; 1 << 16];
    let (mut seen, mut held, mut tamper) = (0usize, Vec::new(), tamper);
    while let Ok(n @ 1..) = from.read(&mut buf) {
        log.lock().unwrap().extend_from_slice(&buf[..n]);
        let mut bytes = &buf[..n];
        if seen < handshake {
            let k = (handshake - seen).min(n);
            if to.write_all(&bytes[..k]).is_err() {
                break;
            }
            seen += k;
            bytes = &bytes[k..];
        }
        if bytes.is_empty() {
            continue;
        }
        let Some(t) = &tamper else {
            if to.write_all(bytes).is_err() {
                break;
            }
            continue;
        };
        held.extend_from_slice(bytes);
        if held.len() < t.need {
            continue;
        }
        let t = tamper.take().unwrap();
        let keep = (t.edit)(&mut held);
        let _ = to.write_all(&held);
        held.clear();
        if !keep {
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
            return;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A relay in front of `to` for one connection: its address, and what went up and down.
fn relay(to: SocketAddr, up: Option<Tamper>, down: Option<Tamper>) -> (SocketAddr, Log, Log) {
    relay_lane(to, 0, up, down)
}

/// A relay in front of `to` for every connection made to it, which tampers with and logs
/// only connection number `lane` (from 0, in the order accepted); the others pass through.
fn relay_lane(
    to: SocketAddr,
    lane: usize,
    up: Option<Tamper>,
    down: Option<Tamper>,
) -> (SocketAddr, Log, Log) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (u, d) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let (mut up, mut down) = (up, down);
    let (lu, ld) = (Arc::clone(&u), Arc::clone(&d));
    std::thread::spawn(move || {
        for i in 0.. {
            let Ok((client, _)) = listener.accept() else { return };
            let Ok(server) = TcpStream::connect(to) else { return };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (up, down, lu, ld) = if i == lane {
                (up.take(), down.take(), Arc::clone(&lu), Arc::clone(&ld))
            } else {
                (None, None, Log::default(), Log::default())
            };
            std::thread::spawn(move || pump(c2, s2, UP_HANDSHAKE, up, lu));
            std::thread::spawn(move || pump(server, client, DOWN_HANDSHAKE, down, ld));
        }
    });
    (addr, u, d)
}

/// A server exporting a patterned 1 MiB arena, writable, with `protection`.
fn server(protection: Protection) -> umbp_remote::RemoteServer {
    let arena: Vec<u8> = (0..ARENA).map(arena_byte).collect();
    ServerBuilder::new(RemoteConfig { protection, ..config("tcp") })
        .export("arena", arena, true)
        .serve("127.0.0.1:0")
        .unwrap()
}

fn engine(protection: Protection) -> RemoteEngine {
    engine_with_lanes(protection, 1)
}

/// An engine whose links have `lanes` connections. (The cases that count a session's records
/// use one: with two, which lane carries which request depends on when answers come back.)
fn engine_with_lanes(protection: Protection, lanes: usize) -> RemoteEngine {
    // No heartbeat in the middle of the records the relays count (a slow machine could
    // otherwise put one before the batch's requests).
    let config = RemoteConfig {
        protection,
        lanes,
        peer_timeout: Duration::from_secs(3),
        heartbeat: Duration::from_secs(600),
        ..config("tcp")
    };
    RemoteEngine::new(EndpointRegistry::new(), config).unwrap()
}

/// What one batch came to: the failed tags, the restored bytes, and the arena afterwards.
struct Outcome {
    failed: HashSet<u32>,
    restored: Vec<u8>,
    arena: Vec<u8>,
    peer_died: bool,
    /// The server's clients once the peer died (every lane of its link closed: none).
    clients_left: usize,
}

/// One batch through `addr` (a relay in front of `server`): object 0 gets the arena's first
/// piece, object 1 its third, object 2 puts a piece at [`PUT_AT`]. Then the server shuts
/// down and hands its arena back.
fn batch(engine: &RemoteEngine, addr: SocketAddr, server: umbp_remote::RemoteServer) -> Outcome {
    let peer = engine.connect(addr).unwrap();
    let remote = engine.register_remote(peer.regions[0].region, 0, ARENA as u64).unwrap();
    let sink = engine.register_memory(vec![POISON; 2 * PIECE]).unwrap();
    let source =
        engine.register_memory((0..PIECE).map(outgoing_byte).collect::<Vec<u8>>()).unwrap();
    let mut builder = engine.incremental_builder();
    let p = PIECE as u64;
    let pieces = [
        (remote.id(), 0, sink.id(), 0),
        (remote.id(), 2 * p, sink.id(), p),
        (source.id(), 0, remote.id(), PUT_AT as u64),
    ];
    for (tag, (src, src_at, dst, dst_at)) in pieces.into_iter().enumerate() {
        let tag = Tag::new(tag as u32);
        builder.begin_object(tag).unwrap();
        builder.push(Fragment::new(src, src_at, dst, dst_at, p, tag)).unwrap();
        builder.commit_object().unwrap();
    }
    let mut handle = engine.submit(builder.finish().unwrap());
    let failures = handle.wait().to_vec();
    drop(handle);
    let failed = failures.iter().flat_map(|f| f.tags.iter().map(|t| t.get())).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.is_alive(peer.id) && !failures.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let peer_died = !engine.is_alive(peer.id);
    while peer_died && server.clients() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let clients_left = server.clients();
    let restored = sink.deregister();
    drop(source);
    let arena = server.shutdown().take::<Vec<u8>>("arena").unwrap();
    Outcome { failed, restored, arena, peer_died, clients_left }
}

/// Checks an outcome: the objects in `must_fail` failed, every completed object's bytes are
/// right, no byte of the arena but the put's changed, and the put's bytes are the client's or
/// the old ones, never anything else (`lands: Some(false)`: the old ones).
fn check(what: &str, o: &Outcome, must_fail: &[u32], lands: Option<bool>) {
    for tag in must_fail {
        assert!(o.failed.contains(tag), "{what}: object {tag} was reported completed");
    }
    if !must_fail.is_empty() {
        assert!(o.peer_died, "{what}: the connection stayed open");
        assert_eq!(o.clients_left, 0, "{what}: the server still serves the dead link");
    }
    for (tag, at) in [(0u32, 0usize), (1, 2 * PIECE)] {
        if !o.failed.contains(&tag) {
            let got = &o.restored[tag as usize * PIECE..(tag as usize + 1) * PIECE];
            let wrong = (0..PIECE).find(|&i| got[i] != arena_byte(at + i));
            assert_eq!(wrong, None, "{what}: object {tag} completed with wrong bytes");
        }
    }
    let outside = (0..ARENA)
        .filter(|i| !(PUT_AT..PUT_AT + PIECE).contains(i))
        .find(|&i| o.arena[i] != arena_byte(i));
    assert_eq!(outside, None, "{what}: a byte outside the put's range changed");
    let put = &o.arena[PUT_AT..PUT_AT + PIECE];
    let old = (0..PIECE).all(|i| put[i] == arena_byte(PUT_AT + i));
    let new = (0..PIECE).all(|i| put[i] == outgoing_byte(i));
    if !o.failed.contains(&2) {
        assert!(new, "{what}: the put completed but its bytes are not at the server");
    }
    match lands {
        Some(false) => assert!(old, "{what}: the put's bytes landed"),
        _ => assert!(old || new, "{what}: bytes nobody sent landed"),
    }
}

#[test]
fn an_honest_session_through_a_relay_lays_out_as_the_tests_expect() {
    if !ucx_or_skip() {
        return;
    }
    // Authenticated only: the headers travel in the clear, so the layout can be read.
    let server = server(Protection::Authenticated);
    let (addr, up, down) = relay(server.local_addr(), None, None);
    let engine = engine(Protection::Authenticated);
    let o = batch(&engine, addr, server);
    assert!(o.failed.is_empty(), "{:?}", o.failed);
    assert!(!o.peer_died);
    check_unchanged_but_put(&o);
    let (up, down) = (up.lock().unwrap().clone(), down.lock().unwrap().clone());
    let up = &up[UP_HANDSHAKE..];
    // Two gets, then the put and its bytes (then heartbeats, if the machine was slow).
    assert!(up.len() >= 3 * REQ + DATA, "{} bytes up", up.len());
    assert_eq!([up[0], up[REQ], up[2 * REQ]], [1, 1, 2], "requests in the order expected");
    assert_eq!(up[3 * REQ..3 * REQ + PIECE], (0..PIECE).map(outgoing_byte).collect::<Vec<_>>());
    let down = &down[DOWN_HANDSHAKE..];
    assert!(down.len() >= 3 * ANS + 2 * DATA, "{} bytes down", down.len());
    assert_eq!([down[0], down[ANS + DATA], down[2 * (ANS + DATA)]], [0, 0, 0]);
    assert_eq!(u64::from_le_bytes(down[16..24].try_into().unwrap()), PIECE as u64);
}

fn check_unchanged_but_put(o: &Outcome) {
    check("honest", o, &[], None);
}

/// Every tampering of the session after the handshake: what it does, which way, what it
/// does to the bytes, the objects that must fail, and whether the put may land.
fn tamperings() -> Vec<Case> {
    let (r, a, d) = (REQ, ANS, DATA);
    vec![
        ("a bit of a get request", true, flip(r, 10), vec![0, 1, 2], Some(false)),
        ("a bit of the put's request", true, flip(3 * r, 2 * r + 20), vec![2], Some(false)),
        ("a bit of the put's bytes", true, flip(3 * r + 1000, 3 * r + 500), vec![2], Some(false)),
        ("a bit of the put's tag", true, flip(3 * r + d, 3 * r + PIECE + 3), vec![2], Some(false)),
        (
            "a request replayed",
            true,
            edit(r, |b| {
                let first = b[..REQ].to_vec();
                b.splice(REQ..REQ, first);
            }),
            vec![1, 2],
            Some(false),
        ),
        (
            "a request dropped",
            true,
            edit(2 * r, |b| drop(b.drain(REQ..2 * REQ))),
            vec![1, 2],
            Some(false),
        ),
        (
            "two requests reordered",
            true,
            edit(2 * r, |b| {
                let first: Vec<u8> = b.drain(..REQ).collect();
                b.splice(REQ..REQ, first);
            }),
            vec![0, 1, 2],
            Some(false),
        ),
        (
            "a record injected before the requests",
            true,
            edit(0, |b| drop(b.splice(0..0, [0x42u8; REQ]))),
            vec![0, 1, 2],
            Some(false),
        ),
        ("the put's bytes cut short", true, cut(3 * r + 1000, 3 * r + 1000), vec![2], Some(false)),
        ("a bit of an answer", false, flip(a, 3), vec![0, 1, 2], None),
        ("a bit of a get's bytes", false, flip(a + 1000, a + 777), vec![0, 1, 2], None),
        ("a bit of a get's tag", false, flip(a + d, a + PIECE + 5), vec![0, 1, 2], None),
        (
            "an answer replayed",
            false,
            edit(a + d, |b| {
                let first = b[..ANS + DATA].to_vec();
                b.splice(ANS + DATA..ANS + DATA, first);
            }),
            vec![1, 2],
            None,
        ),
        (
            "an answer dropped",
            false,
            edit(2 * (a + d), |b| drop(b.drain(ANS + DATA..2 * (ANS + DATA)))),
            vec![1, 2],
            None,
        ),
        (
            "two answers reordered",
            false,
            edit(2 * (a + d), |b| {
                let first: Vec<u8> = b.drain(..ANS + DATA).collect();
                b.splice(ANS + DATA..ANS + DATA, first);
            }),
            vec![0, 1, 2],
            None,
        ),
        (
            "an answer injected before its request",
            false,
            edit(0, |b| drop(b.splice(0..0, [0u8; ANS]))),
            vec![0, 1, 2],
            None,
        ),
        ("a get's bytes cut short", false, cut(a + 5000, a + 5000), vec![0, 1, 2], None),
        ("a bit of the put's answer", false, flip(2 * (a + d) + a, 2 * (a + d) + 2), vec![2], None),
    ]
}

#[test]
fn a_tampered_session_is_refused_closed_and_lands_nothing_forged() {
    if !ucx_or_skip() {
        return;
    }
    for protection in [Protection::Encrypted, Protection::Authenticated] {
        for (what, up, tamper, must_fail, lands) in tamperings() {
            let server = server(protection);
            let (addr, _, _) = if up {
                relay(server.local_addr(), Some(tamper), None)
            } else {
                relay(server.local_addr(), None, Some(tamper))
            };
            let engine = engine(protection);
            let o = batch(&engine, addr, server);
            let what = format!("{what} ({protection:?})");
            check(&what, &o, &must_fail, lands);
            eprintln!("{what}: objects {:?} failed, connection closed", {
                let mut f: Vec<_> = o.failed.iter().copied().collect();
                f.sort_unstable();
                f
            });
        }
    }
}

/// A link of two lanes, one of them tampered with (a bit of a get's bytes flipped on the
/// second connection): the get on it fails, the whole peer is declared dead and every lane
/// closes (the server serves none of them after), objects the other lane completed are
/// right, and nothing forged lands. Which lane carries which request depends on when answers
/// come back, so a run whose second lane carried no get (its answers came before the next
/// request was posted) is run again.
#[test]
fn a_tampered_lane_ends_the_whole_link_and_lands_nothing_forged() {
    if !ucx_or_skip() {
        return;
    }
    let (a, d) = (ANS, DATA);
    for protection in [Protection::Encrypted, Protection::Authenticated] {
        let tampered = (0..5).find_map(|_| {
            let server = server(protection);
            let (addr, _, down) =
                relay_lane(server.local_addr(), 1, None, Some(flip(a + 1000, a + 777)));
            let engine = engine_with_lanes(protection, 2);
            let o = batch(&engine, addr, server);
            let carried = down.lock().unwrap().len() >= DOWN_HANDSHAKE + a + d;
            carried.then_some(o)
        });
        let o = tampered.expect("the second lane carried a get in one of five runs");
        let what = format!("a bit of a get's bytes on the second lane ({protection:?})");
        assert!(!o.failed.is_empty(), "{what}: every object completed");
        check(&what, &o, &[], None);
        assert!(o.peer_died, "{what}: the peer stayed alive");
        assert_eq!(o.clients_left, 0, "{what}: a lane stayed open at the server");
        eprintln!("{what}: objects {:?} failed, every lane closed", o.failed);
    }
}

/// Reads whatever `s` sends until it closes (or 5 s pass): what the relay got.
fn read_all(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = s.read(&mut buf) {
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// A fake server (a squatted port, a stale address) that relays the honest client's handshake
/// to the real server, then uses the session itself: it asks the real server for bytes and
/// tries to write into the arena, and answers the honest client with bytes of its own.
#[test]
fn a_relay_that_forwarded_the_handshake_can_neither_use_the_session_nor_fool_the_client() {
    if !ucx_or_skip() {
        return;
    }
    for protection in [Protection::Encrypted, Protection::Authenticated] {
        let server = server(protection);
        let to = server.local_addr();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let from_server = Arc::new(Mutex::new(None));
        let got = Arc::clone(&from_server);
        let relay = std::thread::spawn(move || {
            let (mut client, _) = listener.accept().unwrap();
            let mut server = TcpStream::connect(to).unwrap();
            // The handshake, forwarded as it is, in its order.
            let forward = |from: &mut TcpStream, to: &mut TcpStream, n: usize| {
                let mut b = vec![0u8; n];
                from.read_exact(&mut b).unwrap();
                to.write_all(&b).unwrap();
            };
            forward(&mut client, &mut server, 45);
            forward(&mut server, &mut client, 78);
            forward(&mut client, &mut server, 32);
            forward(&mut server, &mut client, DOWN_HANDSHAKE - 78);
            // Now an authenticated client of the real server, as far as the handshake goes:
            // a get of the arena, a put into it (headers as the protocol lays them out, tags
            // of zeros: the relay has no key), and the honest client's own first request.
            let mut own = Vec::new();
            let mut get = [0u8; 32];
            get[0] = 1;
            get[24..].copy_from_slice(&(ARENA as u64).to_le_bytes());
            own.extend_from_slice(&get);
            own.extend_from_slice(&[0u8; 16]);
            let mut put = [0u8; 32];
            put[0] = 2;
            put[16..24].copy_from_slice(&(PUT_AT as u64).to_le_bytes());
            put[24..].copy_from_slice(&(PIECE as u64).to_le_bytes());
            own.extend_from_slice(&put);
            own.extend_from_slice(&[0u8; 16]);
            own.extend_from_slice(&vec![0xEE; PIECE + 16]);
            let _ = server.write_all(&own);
            *got.lock().unwrap() = Some(read_all(&mut server));
            // The honest client's requests: read, never forwarded, answered with invented
            // bytes (a done get of its pieces, a done put).
            let mut requests = [0u8; 3 * REQ + DATA];
            client.read_exact(&mut requests).unwrap();
            let mut answers = Vec::new();
            for id in 0..3u64 {
                let mut a = [0u8; 24];
                a[8..16].copy_from_slice(&id.to_le_bytes());
                let len = if id < 2 { PIECE as u64 } else { 0 };
                a[16..].copy_from_slice(&len.to_le_bytes());
                answers.extend_from_slice(&a);
                answers.extend_from_slice(&[0u8; 16]);
                if id < 2 {
                    answers.extend_from_slice(&vec![0xEE; PIECE + 16]);
                }
            }
            let _ = client.write_all(&answers);
            std::thread::sleep(Duration::from_millis(500));
        });
        let engine = engine(protection);
        let o = batch(&engine, addr, server);
        relay.join().unwrap();
        let what = format!("relay ({protection:?})");
        // The honest client reported nothing the relay invented as completed.
        check(&what, &o, &[0, 1, 2], Some(false));
        assert!(!o.restored.windows(64).any(|w| w == [0xEE; 64]) || o.failed.len() == 3);
        // The real server answered the relay nothing and closed.
        let answered = from_server.lock().unwrap().take().unwrap();
        assert!(answered.is_empty(), "{what}: the server sent the relay {} bytes", answered.len());
    }
}

/// A recorded session's bytes sent again on a new connection: the server's fresh nonce makes
/// the recorded proof stale, and nothing after it is read.
#[test]
fn a_recorded_session_replayed_on_a_new_connection_is_refused() {
    if !ucx_or_skip() {
        return;
    }
    let server = server(Protection::Encrypted);
    let to = server.local_addr();
    let (addr, up, _) = relay(to, None, None);
    let engine = engine(Protection::Encrypted);
    let peer = engine.connect(addr).unwrap();
    let remote = engine.register_remote(peer.regions[0].region, 0, ARENA as u64).unwrap();
    let source = engine.register_memory(vec![0x99u8; PIECE]).unwrap();
    let mut builder = engine.incremental_builder();
    builder.begin_object(Tag::new(0)).unwrap();
    builder
        .push(Fragment::new(source.id(), 0, remote.id(), PUT_AT as u64, PIECE as u64, Tag::new(0)))
        .unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty());
    drop(handle);
    drop(engine);
    // The arena now holds 0x99 at the put; put the old bytes back through a fresh session...
    let recorded = up.lock().unwrap().clone();
    let engine2 = self::engine(Protection::Encrypted);
    let peer = engine2.connect(to).unwrap();
    let remote = engine2.register_remote(peer.regions[0].region, 0, ARENA as u64).unwrap();
    let old: Vec<u8> = (0..PIECE).map(|i| arena_byte(PUT_AT + i)).collect();
    let source = engine2.register_memory(old).unwrap();
    let mut builder = engine2.incremental_builder();
    builder.begin_object(Tag::new(0)).unwrap();
    builder
        .push(Fragment::new(source.id(), 0, remote.id(), PUT_AT as u64, PIECE as u64, Tag::new(0)))
        .unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine2.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty());
    drop(handle);
    drop(engine2);
    // ...and replay the whole recorded session (its put of 0x99) on a new connection.
    let mut s = TcpStream::connect(to).unwrap();
    s.write_all(&recorded[..45]).unwrap();
    let mut challenge = [0u8; 78];
    s.read_exact(&mut challenge).unwrap();
    let _ = s.write_all(&recorded[45..]);
    assert_eq!(read_all(&mut s), [1], "a replayed proof got more than a refusal");
    let arena = server.shutdown().take::<Vec<u8>>("arena").unwrap();
    assert!((0..ARENA).all(|i| arena[i] == arena_byte(i)), "the replayed put landed");
}

/// 64 authenticated clients that go silent (no heartbeat, no request, no FIN: a process or
/// network that vanished) hold every slot; the idle timeout frees them all, and an honest
/// client that idles far longer keeps its slot through its heartbeats.
#[test]
fn clients_that_vanish_lose_their_slots_and_idle_honest_ones_keep_theirs() {
    if !ucx_or_skip() {
        return;
    }
    let idle_timeout = Duration::from_secs(1);
    let limits = umbp_remote::ServerLimits {
        max_clients: 64,
        max_clients_per_ip: 64,
        ..umbp_remote::ServerLimits::default()
    };
    let server = ServerBuilder::new(RemoteConfig { idle_timeout, limits, ..config("tcp") })
        .export("arena", (0..ARENA).map(arena_byte).collect::<Vec<u8>>(), true)
        .serve("127.0.0.1:0")
        .unwrap();
    let addr = server.local_addr();
    let mut silent = Vec::new();
    for _ in 0..64 {
        let mut s = TcpStream::connect(addr).unwrap();
        internal::handshake(&mut s, SECRET.as_bytes(), Protection::Encrypted).unwrap();
        silent.push(s);
    }
    let full = engine(Protection::Encrypted).connect(addr).unwrap_err();
    assert!(matches!(full, Error::Handshake { source: HandshakeError::Refused(_), .. }), "{full}");
    let started = Instant::now();
    while server.clients() > 0 {
        // Bounded only as a never-frees signal: the idle timeout is 1 s.
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{} silent clients still hold their slots",
            server.clients()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("64 silent clients freed {:?} after the server was full", started.elapsed());
    for s in &mut silent {
        assert!(read_all(s).is_empty(), "the server sent a silent client something");
    }
    // An honest client idles three idle timeouts, then restores.
    let config = RemoteConfig { heartbeat: Duration::from_millis(200), ..config("tcp") };
    let honest = RemoteEngine::new(EndpointRegistry::new(), config).unwrap();
    let peer = honest.connect(addr).unwrap();
    assert_eq!(peer.lanes, 2, "the default lanes");
    std::thread::sleep(3 * idle_timeout);
    assert_eq!(server.clients(), 2, "an idle client with heartbeats lost a lane's slot");
    let remote = honest.register_remote(peer.regions[0].region, 0, ARENA as u64).unwrap();
    let sink = honest.register_memory(vec![POISON; PIECE]).unwrap();
    let mut builder = honest.incremental_builder();
    builder.begin_object(Tag::new(0)).unwrap();
    builder
        .push(Fragment::new(remote.id(), 4096, sink.id(), 0, PIECE as u64, Tag::new(0)))
        .unwrap();
    builder.commit_object().unwrap();
    let mut handle = honest.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
    drop(handle);
    assert!(sink.deregister().iter().enumerate().all(|(i, &b)| b == arena_byte(4096 + i)));
}

/// A flood of connections from the honest client's own address (each connects, says nothing,
/// and stays a while): every honest connect still succeeds, as the accept loop advances handshakes
/// between bounded batches of accepts.
#[test]
fn honest_clients_connect_through_a_connect_flood_from_their_own_address() {
    if !ucx_or_skip() {
        return;
    }
    let server = server(Protection::Encrypted);
    let addr = server.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let floods: Vec<_> = (0..2)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                // Each keeps its 256 latest connections open: far past the server's 64
                // handshakes per address, so every accept closes one of them.
                let (mut n, mut open) = (0u64, std::collections::VecDeque::new());
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(s) = TcpStream::connect(addr) {
                        n += 1;
                        open.push_back(s);
                        if open.len() > 256 {
                            open.pop_front();
                        }
                    }
                }
                n
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let engine = engine(Protection::Encrypted);
    let mut failed = Vec::new();
    for i in 0..30 {
        match engine.connect(addr) {
            Ok(peer) => engine.disconnect(peer.id).unwrap(),
            Err(e) => failed.push(format!("connect {i}: {e}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let flooded: u64 = floods.into_iter().map(|t| t.join().unwrap()).sum();
    eprintln!("{flooded} flood connections beside 30 honest connects");
    assert!(failed.is_empty(), "{} of 30 honest connects failed: {failed:?}", failed.len());
}

/// A client that asks for encryption refuses a session that a relay (or a server) would make
/// weaker; a server that asks for it encrypts a session the client asked only authenticated.
#[test]
fn a_session_is_encrypted_when_either_side_asks_and_never_downgraded() {
    if !ucx_or_skip() {
        return;
    }
    // The client asks authenticated only, the server wants encryption: encrypted, so an
    // observer sees none of the restored bytes.
    let first = server(Protection::Encrypted);
    let (addr, _, down) = relay(first.local_addr(), None, None);
    let o = batch(&engine(Protection::Authenticated), addr, first);
    assert!(o.failed.is_empty(), "{:?}", o.failed);
    let down = down.lock().unwrap().clone();
    let piece: Vec<u8> = (0..64).map(arena_byte).collect();
    assert!(!down.windows(64).any(|w| w == piece), "restored bytes crossed in the clear");
    // A relay that rewrites the client's "encrypted" to "authenticated" in its hello: the
    // server agrees to authenticated only, and the client, which asked for encryption,
    // refuses.
    let weak = server(Protection::Authenticated);
    let to = weak.local_addr();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(to).unwrap();
        let mut hello = [0u8; 45];
        client.read_exact(&mut hello).unwrap();
        hello[44] = 1;
        server.write_all(&hello).unwrap();
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || pump(c2, s2, 0, None, Arc::default()));
        pump(server, client, 0, None, Arc::default());
    });
    let e = engine(Protection::Encrypted).connect(addr).unwrap_err();
    assert!(matches!(e, Error::Handshake { source: HandshakeError::Refused(_), .. }), "{e}");
    // The same relay in front of a server that wants encryption: the challenge says
    // encrypted, but the keys bind the rewritten hello, so the welcome does not open.
    let strong = server(Protection::Encrypted);
    let to = strong.local_addr();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(to).unwrap();
        let mut hello = [0u8; 45];
        client.read_exact(&mut hello).unwrap();
        hello[44] = 1;
        server.write_all(&hello).unwrap();
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || pump(c2, s2, 0, None, Arc::default()));
        pump(server, client, 0, None, Arc::default());
    });
    let e = engine(Protection::Encrypted).connect(addr).unwrap_err();
    assert!(matches!(e, Error::Handshake { source: HandshakeError::Forged, .. }), "{e}");
    drop((weak, strong));
}
