//! The pool's data path through memory nodes: clients' `umbp_pool::Pool`s reach real
//! `umbp-ucx-serve` processes through `MemoryNodeResolver`, over a real `redis-server`. Blocks put into
//! a node's tier come back byte for byte to another client; a node that leaves (SIGTERM) is a
//! miss at once; a node killed mid-get fails only its own blocks, as load errors, and is a
//! miss once its announcement expires.

#[path = "support/pool.rs"]
mod pool_support;
mod support;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pool_support::{available, Node, RedisServer};
use umbp_composite::CompositeEngine;
use umbp_localcopy::LocalCopyEngine;
use umbp_memory_node::MemoryNodeResolver;
use umbp_plan::{EndpointRegistry, Register, TransferEngine};
use umbp_pool::{
    BlockError, BlockKey, GetBlock, GetOutcome, NodeId, Pool, PoolConfig, PutBlock, PutOutcome,
    TierId,
};
use umbp_remote::RemoteEngine;

const POISON: u8 = 0xA5;

/// A client of the pool `name`: its own engines, composite, resolver and pool, as node `node`.
struct Client {
    pool: Pool,
    resolver: Arc<MemoryNodeResolver>,
    composite: CompositeEngine,
}

fn client(redis: &RedisServer, name: &str, node: u32) -> Client {
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let ucx = Arc::new(RemoteEngine::new(registry.clone(), support::config("tcp")).unwrap());
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, ucx.clone()];
    let composite = CompositeEngine::new(registry, engines);
    let resolver = Arc::new(MemoryNodeResolver::new(ucx, composite.clone()).unwrap());
    let pool = Pool::with_resolver(
        Arc::new(redis.index(name).unwrap()),
        composite.clone(),
        PoolConfig::new(NodeId(node)),
        Some(resolver.clone()),
    )
    .unwrap();
    Client { pool, resolver, composite }
}

/// The flags of memory node `node` in pool `name`: one writable region `kv` of `region`, a
/// read-only `ro` before it (so the writable one is tier 1), slots of `slot`, and `extra`.
fn node_args(
    redis: &RedisServer,
    dir: &Path,
    name: &str,
    node: u32,
    ttl_ms: u64,
    (region, slot): (&str, &str),
    extra: &[&str],
) -> Vec<String> {
    let kv = format!("kv={region}");
    pool_support::node_args(redis, dir, name, node, ttl_ms, &["ro=64KiB:ro", &kv], slot, extra)
}

/// The writable region of a node started with [`node_args`].
const KV: TierId = TierId(1);

/// Block `i` of node `node`'s set: its key, and its bytes (`len` of them).
fn key(node: u32, i: usize) -> BlockKey {
    BlockKey::from_u128((u128::from(node) << 64 | i as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn block(node: u32, i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|b| (b as u32).wrapping_mul(31).wrapping_add(node * 7 + i as u32 * 13) as u8)
        .collect()
}

/// Puts blocks `0..n` of `node`'s set (each `len` bytes, the last one shorter) into tier `KV`
/// of `node` through `c`: every one stored.
fn put_blocks(c: &Client, node: u32, n: usize, len: usize) -> Vec<Vec<u8>> {
    let blocks: Vec<Vec<u8>> =
        (0..n).map(|i| block(node, i, if i == n - 1 { len - 1000 } else { len })).collect();
    let src = c.composite.register_memory(blocks.concat()).unwrap();
    let mut offset = 0;
    let puts: Vec<PutBlock> = blocks
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let p = PutBlock { key: key(node, i), src: src.id(), offset, len: b.len() as u64 };
            offset += b.len() as u64;
            p
        })
        .collect();
    let out = c.pool.put_on(NodeId(node), KV, &puts).unwrap();
    for (i, o) in out.iter().enumerate() {
        match o {
            PutOutcome::Stored(p) => {
                assert_eq!((p.node, p.tier, p.len), (NodeId(node), KV, blocks[i].len() as u64))
            }
            other => panic!("block {i} of node {node}: {other:?}"),
        }
    }
    blocks
}

/// Gets `keys` into slots of `len` bytes of a fresh poisoned buffer: the outcomes and the
/// buffer.
fn get_blocks(c: &Client, keys: &[BlockKey], len: usize) -> (Vec<GetOutcome>, Vec<u8>) {
    let dst = c.composite.register_memory(vec![POISON; keys.len() * len]).unwrap();
    let gets: Vec<GetBlock> = keys
        .iter()
        .enumerate()
        .map(|(i, &key)| GetBlock {
            key,
            dst: dst.id(),
            offset: (i * len) as u64,
            capacity: len as u64,
        })
        .collect();
    let out = c.pool.get(&gets).unwrap();
    (out, dst.deregister())
}

/// Blocks put into a memory node's tier by one client come back byte for byte to another
/// (each with its own engine, composite and connection), the read-only region is no tier, a
/// second put finds them present; after SIGTERM the node has left: every get is a miss at
/// once (its TTL is a minute), and a put to it fails cleanly.
#[test]
fn blocks_put_into_a_memory_node_come_back_byte_for_byte_and_miss_once_it_left() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    const LEN: usize = 64 << 10;
    let mut node =
        Node::start(&node_args(&redis, dir.path(), "data", 10, 60_000, ("4MiB", "64KiB"), &[]))
            .unwrap();
    let writer = client(&redis, "data", 100);
    let blocks = put_blocks(&writer, 10, 48, LEN);
    assert_eq!(writer.resolver.connected(), [(NodeId(10), node.addr.to_string())]);

    let reader = client(&redis, "data", 101);
    let keys: Vec<BlockKey> = (0..48).map(|i| key(10, i)).collect();
    let (out, bytes) = get_blocks(&reader, &keys, LEN);
    for (i, (o, b)) in out.iter().zip(&blocks).enumerate() {
        assert!(o.is_loaded(), "block {i}: {o:?}");
        let got = &bytes[i * LEN..i * LEN + b.len()];
        assert!(got == &b[..], "block {i}: other bytes");
        assert!(bytes[i * LEN + b.len()..(i + 1) * LEN].iter().all(|&x| x == POISON));
    }
    assert_eq!(reader.pool.metrics().hits.load(Ordering::Relaxed), 48);
    // Again: present, nothing written.
    let again = writer.pool.put_on(
        NodeId(10),
        KV,
        &[PutBlock {
            key: key(10, 0),
            src: writer.composite.register_memory(vec![0u8; LEN]).unwrap().id(),
            offset: 0,
            len: LEN as u64,
        }],
    );
    assert!(matches!(again.unwrap()[..], [PutOutcome::Present(_)]));
    // The read-only region (tier 0) is no tier of the pool.
    let ro = writer.pool.put_on(
        NodeId(10),
        TierId(0),
        &[PutBlock {
            key: key(10, 999),
            src: writer.composite.register_memory(vec![0u8; 16]).unwrap().id(),
            offset: 0,
            len: 16,
        }],
    );
    assert!(matches!(ro.unwrap()[..], [PutOutcome::Failed(_)]));

    let status = node.signal(libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", node.log());
    let (out, bytes) = get_blocks(&reader, &keys, LEN);
    assert!(out.iter().all(|o| matches!(o, GetOutcome::Miss)), "{out:?}");
    assert!(bytes.iter().all(|&x| x == POISON), "a miss wrote bytes");
    let src = writer.composite.register_memory(vec![1u8; LEN]).unwrap();
    let late = writer
        .pool
        .put_on(
            NodeId(10),
            KV,
            &[PutBlock { key: key(10, 500), src: src.id(), offset: 0, len: 16 }],
        )
        .unwrap();
    assert!(matches!(late[..], [PutOutcome::Failed(_)]), "{late:?}");
}

/// Two memory nodes; a reader loads all their blocks in a loop while one node is SIGKILLed.
/// Every block loaded is byte-exact; the survivor's blocks always load; the dead node's fail
/// as load errors (never a hit with other bytes) until its announcement expires, then miss.
/// The resolver drops the dead node's connection.
#[test]
fn a_memory_node_killed_mid_get_fails_only_its_blocks_then_misses_after_its_ttl() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    const LEN: usize = 256 << 10;
    const N: usize = 24;
    let args = |node| node_args(&redis, dir.path(), "kill", node, 3000, ("8MiB", "256KiB"), &[]);
    let mut doomed = Node::start(&args(20)).unwrap();
    let survivor = Node::start(&args(21)).unwrap();
    let writer = client(&redis, "kill", 200);
    let mut expected = put_blocks(&writer, 20, N, LEN);
    expected.extend(put_blocks(&writer, 21, N, LEN));
    let keys: Vec<BlockKey> =
        (0..N).map(|i| key(20, i)).chain((0..N).map(|i| key(21, i))).collect();

    let reader = Arc::new(client(&redis, "kill", 201));
    let stop = Arc::new(AtomicBool::new(false));
    let (round_tx, rounds) = mpsc::channel::<(Instant, Instant, Vec<GetOutcome>)>();
    let loader = {
        let (reader, stop, keys, expected) =
            (reader.clone(), stop.clone(), keys.clone(), expected.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let (out, bytes) = get_blocks(&reader, &keys, LEN);
                for (i, o) in out.iter().enumerate() {
                    let b = &expected[i];
                    if o.is_loaded() {
                        assert!(
                            bytes[i * LEN..i * LEN + b.len()] == b[..],
                            "block {i}: wrong bytes served"
                        );
                    }
                }
                if round_tx.send((started, Instant::now(), out)).is_err() {
                    return;
                }
            }
        })
    };
    // Three whole rounds, then the kill.
    for _ in 0..3 {
        let (_, _, out) = rounds.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(out.iter().all(GetOutcome::is_loaded), "{out:?}");
    }
    assert!(doomed.signal(libc::SIGKILL, Duration::from_secs(10)).is_some());
    let killed = Instant::now();
    let (mut failed_rounds, mut in_flight_at_kill) = (0, false);
    let until = killed + Duration::from_secs(30);
    loop {
        let (started, ended, out) = rounds.recv_timeout(Duration::from_secs(30)).unwrap();
        let (dead, alive) = out.split_at(N);
        assert!(alive.iter().all(GetOutcome::is_loaded), "the survivor's blocks: {alive:?}");
        if started < killed && ended > killed {
            in_flight_at_kill = true;
        }
        let failed = dead.iter().filter(|o| matches!(o, GetOutcome::Failed(_))).count();
        for o in dead {
            assert!(
                matches!(
                    o,
                    GetOutcome::Failed(BlockError::Transfer(_) | BlockError::Unreachable { .. })
                ) || (started < killed && o.is_loaded())
                    || matches!(o, GetOutcome::Miss),
                "the dead node's block: {o:?}"
            );
        }
        if failed > 0 {
            failed_rounds += 1;
        }
        if dead.iter().all(|o| matches!(o, GetOutcome::Miss)) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the killed node's blocks did not miss 30 s after the kill"
        );
    }
    let dead_after = killed.elapsed();
    stop.store(true, Ordering::Relaxed);
    drop(rounds);
    loader.join().unwrap();
    eprintln!(
        "killed node: {failed_rounds} gets failed its blocks, then all missed {dead_after:?} after \
         the kill (TTL 3 s); a get was in flight at the kill: {in_flight_at_kill}"
    );
    assert!(failed_rounds >= 1, "no get met the dead node before it expired");
    let m = reader.pool.metrics();
    assert_eq!(m.checksum_failures.load(Ordering::Relaxed), 0);
    assert!(m.get_failures.load(Ordering::Relaxed) >= 1);
    // The dead node's connection is gone; the survivor's stays.
    assert_eq!(reader.resolver.connected(), [(NodeId(21), survivor.addr.to_string())]);
}

/// 16 threads of one client meet a memory node at once (its first contact: no connection yet),
/// then keep loading while 16 threads of another client store: every load is byte-exact,
/// every store lands, and each client holds one connection to the node.
#[test]
fn sixteen_threads_meet_a_memory_node_at_once() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    const LEN: usize = 16 << 10;
    const THREADS: usize = 16;
    let node = Node::start(&node_args(
        &redis,
        dir.path(),
        "many",
        30,
        60_000,
        ("8MiB", "16KiB"),
        &["--metrics", "127.0.0.1:0"],
    ))
    .unwrap();
    let writer = Arc::new(client(&redis, "many", 300));
    let blocks = Arc::new(put_blocks(&writer, 30, 64, LEN));
    let reader = Arc::new(client(&redis, "many", 301));
    let start = Arc::new(std::sync::Barrier::new(THREADS * 2));
    let mut threads = Vec::new();
    for t in 0..THREADS {
        let (reader, blocks, go) = (reader.clone(), blocks.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            go.wait();
            for round in 0..8 {
                let picks: Vec<usize> = (0..8).map(|k| (t * 5 + round * 3 + k * 7) % 64).collect();
                let keys: Vec<BlockKey> = picks.iter().map(|&i| key(30, i)).collect();
                let (out, bytes) = get_blocks(&reader, &keys, LEN);
                for (j, (&i, o)) in picks.iter().zip(&out).enumerate() {
                    assert!(o.is_loaded(), "thread {t} block {i}: {o:?}");
                    let b = &blocks[i];
                    assert!(bytes[j * LEN..j * LEN + b.len()] == b[..], "thread {t} block {i}");
                }
            }
        }));
        let (writer, go) = (writer.clone(), start.clone());
        threads.push(std::thread::spawn(move || {
            go.wait();
            let own: Vec<u8> = block(31, t, LEN);
            let src = writer.composite.register_memory(own).unwrap();
            let put = PutBlock { key: key(31, t), src: src.id(), offset: 0, len: LEN as u64 };
            let out = writer.pool.put_on(NodeId(30), KV, &[put]).unwrap();
            assert!(matches!(out[..], [PutOutcome::Stored(_)]), "writer {t}: {out:?}");
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let addr = node.addr.to_string();
    // One link per client (of the default lanes, each a connection): the 16 first contacts
    // waited for one.
    let metrics = pool_support::scrape(node.metrics.unwrap());
    let lanes = umbp_remote::RemoteConfig::default().lanes as u64;
    assert_eq!(pool_support::value(&metrics, "umbp_ucx_serve_clients_admitted_total"), 2 * lanes);
    assert_eq!(reader.resolver.connected(), [(NodeId(30), addr.clone())]);
    assert_eq!(writer.resolver.connected(), [(NodeId(30), addr)]);
    let keys: Vec<BlockKey> = (0..THREADS).map(|t| key(31, t)).collect();
    let (out, bytes) = get_blocks(&reader, &keys, LEN);
    for (t, o) in out.iter().enumerate() {
        assert!(o.is_loaded(), "{o:?}");
        assert!(bytes[t * LEN..(t + 1) * LEN] == block(31, t, LEN)[..]);
    }
}

/// A memory node restarted at its address (SIGTERM, then the same command): clients that
/// reached it before find its old blocks gone, store and load new ones with no failed block
/// (the resolver tells the pool the old connection is dead before a transfer meets it), over
/// one fresh connection each.
#[test]
fn clients_follow_a_memory_node_restarted_at_its_address() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    const LEN: usize = 64 << 10;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let mut args = node_args(&redis, dir.path(), "again", 40, 60_000, ("2MiB", "64KiB"), &[]);
    let at = args.iter().position(|a| a == "127.0.0.1:0").unwrap();
    args[at] = listen.clone();
    let mut node = Node::start(&args).unwrap();
    let writer = client(&redis, "again", 400);
    let reader = client(&redis, "again", 401);
    let old_keys: Vec<BlockKey> = (0..8).map(|i| key(40, i)).collect();
    put_blocks(&writer, 40, 8, LEN);
    assert!(get_blocks(&reader, &old_keys, LEN).0.iter().all(GetOutcome::is_loaded));

    let status = node.signal(libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", node.log());
    drop(node);
    let until = Instant::now() + Duration::from_secs(10);
    while !(writer.resolver.connected().is_empty() && reader.resolver.connected().is_empty()) {
        assert!(Instant::now() < until, "the clients never saw the node's connection close");
        std::thread::sleep(Duration::from_millis(10));
    }
    let _node = Node::start(&args).unwrap();
    let (out, _) = get_blocks(&reader, &old_keys, LEN);
    assert!(out.iter().all(|o| matches!(o, GetOutcome::Miss)), "{out:?}");
    // New blocks under other keys: stored through a new connection, loaded through another.
    let fresh = |i: usize| key(41, i);
    let bytes: Vec<Vec<u8>> = (0..8).map(|i| block(41, i, LEN)).collect();
    let src = writer.composite.register_memory(bytes.concat()).unwrap();
    let puts: Vec<PutBlock> = (0..8)
        .map(|i| PutBlock {
            key: fresh(i),
            src: src.id(),
            offset: (i * LEN) as u64,
            len: LEN as u64,
        })
        .collect();
    let out = writer.pool.put_on(NodeId(40), KV, &puts).unwrap();
    assert!(out.iter().all(|o| matches!(o, PutOutcome::Stored(_))), "{out:?}");
    let keys: Vec<BlockKey> = (0..8).map(fresh).collect();
    let (out, got) = get_blocks(&reader, &keys, LEN);
    assert!(out.iter().all(GetOutcome::is_loaded), "{out:?}");
    assert!(got == bytes.concat());
    for c in [&writer, &reader] {
        assert_eq!(c.pool.metrics().get_failures.load(Ordering::Relaxed), 0);
        assert_eq!(c.pool.metrics().put_failures.load(Ordering::Relaxed), 0);
        assert_eq!(c.resolver.connected(), [(NodeId(40), listen.clone())]);
    }
}

/// A client of a Redis server speaking its protocol (RESP), as a stranger with the pool's
/// password (and not the memory nodes' secret) would: one command, its reply.
struct Resp(std::io::BufReader<std::net::TcpStream>);

/// A reply: a bulk string (or a simple one, or an integer as its digits), or an array of them.
#[derive(Debug)]
enum Reply {
    Bytes(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

impl Resp {
    fn connect(redis: &RedisServer) -> Self {
        let s = std::net::TcpStream::connect(("127.0.0.1", redis.port())).unwrap();
        let mut r = Self(std::io::BufReader::new(s));
        r.call(&[b"AUTH", redis.password().as_bytes()]);
        r
    }

    fn call(&mut self, args: &[&[u8]]) -> Reply {
        use std::io::Write;
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.0.get_mut().write_all(&out).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> Reply {
        use std::io::{BufRead, Read};
        let mut line = String::new();
        self.0.read_line(&mut line).unwrap();
        let (kind, rest) = line.trim_end().split_at(1);
        match kind {
            "+" | ":" => Reply::Bytes(Some(rest.as_bytes().to_vec())),
            "-" => panic!("redis: {rest}"),
            "$" => {
                let Ok(len) = usize::try_from(rest.parse::<i64>().unwrap()) else {
                    return Reply::Bytes(None);
                };
                let mut b = vec![0u8; len + 2];
                self.0.read_exact(&mut b).unwrap();
                b.truncate(len);
                Reply::Bytes(Some(b))
            }
            "*" => {
                Reply::Array((0..rest.parse::<usize>().unwrap()).map(|_| self.reply()).collect())
            }
            other => panic!("redis said {other}{rest}"),
        }
    }
}

impl Reply {
    fn bytes(self) -> Vec<u8> {
        match self {
            Reply::Bytes(Some(b)) => b,
            other => panic!("not bytes: {other:?}"),
        }
    }
}

/// A node announcement's value as umbp-pool stores it: node id, address, tiers' free bytes.
fn decode_announcement(b: &[u8]) -> (u32, String, Vec<u8>) {
    let node = u32::from_be_bytes(b[0..4].try_into().unwrap());
    let len = u32::from_be_bytes(b[4..8].try_into().unwrap()) as usize;
    (node, String::from_utf8(b[8..8 + len].to_vec()).unwrap(), b[8 + len..].to_vec())
}

fn encode_announcement(node: u32, address: &str, tiers: &[u8]) -> Vec<u8> {
    let mut b = node.to_be_bytes().to_vec();
    b.extend_from_slice(&(address.len() as u32).to_be_bytes());
    b.extend_from_slice(address.as_bytes());
    b.extend_from_slice(tiers);
    b
}

/// Whoever can write the pool's Redis (its password, not the memory nodes' secret) points node
/// 1's announcement at node 2's address, keeping its TTL. Node 2 holds the secret, so the
/// handshake alone would take it for node 1: puts meant for node 1 would land in node 2's
/// slots. Its welcome names node 2, so a client refuses it as node 1 (a typed
/// `HandshakeError::WrongNode`): node 1's blocks fail as put and load errors, and every byte
/// of node 2's stored blocks is what was put there.
#[test]
fn an_announcement_pointed_at_another_node_reaches_a_refusal_never_its_slots() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    const LEN: usize = 64 << 10;
    // A two-minute TTL: the nodes renew every 40 s, not while the test runs (checked below).
    let args = |node| node_args(&redis, dir.path(), "moved", node, 120_000, ("1MiB", "64KiB"), &[]);
    let one = Node::start(&args(1)).unwrap();
    let two = Node::start(&args(2)).unwrap();
    let writer = client(&redis, "moved", 300);
    // Node 1's slots 0 to 3, node 2's 0 to 7: a put to node 1 reserves its slots 4 to 7.
    let ones = put_blocks(&writer, 1, 4, LEN);
    let twos = put_blocks(&writer, 2, 8, LEN);

    // The stranger: node 1's announcement, with node 2's address.
    let mut resp = Resp::connect(&redis);
    let keys = match resp.call(&[b"KEYS", b"*:node:1"]) {
        Reply::Array(keys) => keys.into_iter().map(Reply::bytes).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(keys.len(), 1, "{keys:?}");
    let announcement = resp.call(&[b"GET", &keys[0]]).bytes();
    let ttl = resp.call(&[b"PTTL", &keys[0]]).bytes();
    let (node, address, tiers) = decode_announcement(&announcement);
    assert_eq!((node, address.as_str()), (1, one.addr.to_string().as_str()));
    let forged = encode_announcement(1, &two.addr.to_string(), &tiers);
    resp.call(&[b"SET", &keys[0], &forged, b"PX", &ttl]);
    let index = redis.index("moved").unwrap();
    let moved = |index: &umbp_pool::RedisIndex| {
        use umbp_pool::Index;
        index
            .nodes()
            .unwrap()
            .iter()
            .any(|a| a.node == NodeId(1) && a.address == two.addr.to_string())
    };
    assert!(moved(&index), "the forged announcement did not take");

    // A client that meets node 1 now: its puts and loads fail, typed.
    let victim = client(&redis, "moved", 301);
    let src = victim.composite.register_memory(vec![0x5Au8; 4 * LEN]).unwrap();
    let puts: Vec<PutBlock> = (0..4)
        .map(|i| PutBlock {
            key: key(1, 100 + i),
            src: src.id(),
            offset: (i * LEN) as u64,
            len: LEN as u64,
        })
        .collect();
    let out = victim.pool.put_on(NodeId(1), KV, &puts).unwrap();
    assert!(out.iter().all(|o| matches!(o, PutOutcome::Failed(_))), "{out:?}");
    let refusal = victim.resolver.refusal(NodeId(1)).expect("node 1 was refused");
    assert!(
        matches!(
            *refusal,
            umbp_remote::Error::Handshake {
                source: umbp_remote::HandshakeError::WrongNode { expected: 1, named: Some(2) },
                ..
            }
        ),
        "{refusal:?}"
    );
    let (out, bytes) = get_blocks(&victim, &(0..4).map(|i| key(1, i)).collect::<Vec<_>>(), LEN);
    assert!(out.iter().all(|o| matches!(o, GetOutcome::Failed(_))), "{out:?}");
    assert!(bytes.iter().all(|&b| b == POISON), "a refused node's load wrote bytes");
    assert_eq!(victim.resolver.connected(), []);

    // Node 2's blocks: every byte as put, read by the writer (connected to both all along).
    let (out, bytes) = get_blocks(&writer, &(0..8).map(|i| key(2, i)).collect::<Vec<_>>(), LEN);
    for (i, (o, b)) in out.iter().zip(&twos).enumerate() {
        assert!(o.is_loaded(), "node 2's block {i}: {o:?}");
        assert!(bytes[i * LEN..i * LEN + b.len()] == b[..], "node 2's block {i}: other bytes");
    }
    // And node 1's, through the writer's connection made before the forgery: still there.
    let (out, bytes) = get_blocks(&writer, &(0..4).map(|i| key(1, i)).collect::<Vec<_>>(), LEN);
    for (i, (o, b)) in out.iter().zip(&ones).enumerate() {
        assert!(o.is_loaded(), "node 1's block {i}: {o:?}");
        assert!(bytes[i * LEN..i * LEN + b.len()] == b[..], "node 1's block {i}: other bytes");
    }
    // The forgery held all along (no renewal put node 1's address back meanwhile).
    assert!(moved(&index), "node 1 renewed during the test: the check proved nothing");
    drop((one, two));
}
