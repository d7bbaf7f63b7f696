//! `Index::leave`: a node that stops on purpose (a memory node's SIGTERM) leaves the pool at
//! once, in both backends: gone from `nodes()`; in Redis its placements miss at once, its
//! reservations no longer publish, its slots are free and it rejoins empty.

mod support;

use std::time::Duration;

use support::suite::{key, put, reserve, setup, NODE, TTL};
use support::RedisServer;
use umbp_pool::{
    EmbeddedIndex, Error, Index, NodeAnnouncement, NodeId, Published, RedisIndex, TierId, TierSpec,
};

fn announce(index: &dyn Index, node: NodeId, ttl: Duration) {
    index
        .announce(&NodeAnnouncement { node, address: format!("node-{node}"), tiers: vec![] }, ttl)
        .unwrap();
}

fn alive(index: &dyn Index) -> Vec<NodeId> {
    index.nodes().unwrap().iter().map(|n| n.node).collect()
}

#[test]
fn a_node_that_leaves_is_gone_from_redis_at_once() {
    let Some(server) = RedisServer::start() else { return };
    let index = RedisIndex::connect(&support::config(&server, "test")).unwrap();
    // A second client: what a reader elsewhere in the cluster sees.
    let reader = RedisIndex::connect(&support::config(&server, "test")).unwrap();
    let stays = TierSpec::new(NodeId(1), TierId(0), 64, 4);
    let leaves = TierSpec::new(NodeId(2), TierId(0), 64, 4);
    setup(&index, &stays);
    setup(&index, &leaves);
    let kept = put(&index, key(1), &stays);
    let gone = put(&index, key(2), &leaves);
    let pending = reserve(&index, key(3), &leaves, 10);
    let leased = reader.lease(&[gone], TTL).unwrap();
    assert!(leased.all_granted());
    assert_eq!(alive(&reader), [NodeId(1), NodeId(2)]);

    // Leaving, with an announcement good for another minute: effective now, not at its TTL.
    assert!(index.leave(NodeId(2)).unwrap(), "it was alive");
    assert_eq!(alive(&reader), [NodeId(1)]);
    assert_eq!(reader.lookup(&[key(1), key(2)]).unwrap(), vec![Some(kept), None]);
    assert_eq!(reader.prefix_hits(&[key(2), key(1)]).unwrap(), 0);
    assert_eq!(reader.lease(&[kept, gone], TTL).unwrap().granted, vec![true, false]);
    // A write in progress on it publishes nothing; a new one is refused.
    assert_eq!(index.publish(&[(pending, 7)]).unwrap(), vec![Published::Expired]);
    assert_eq!(reader.lookup(&[key(3)]).unwrap(), vec![None]);
    assert!(matches!(
        index.reserve(key(4), NodeId(2), TierId(0), 10, TTL),
        Err(Error::NodeNotAlive(NodeId(2)))
    ));
    // Its slots are free (the lease held on one does not keep a departed node's block), and
    // the reader's lease ends normally.
    let stats = reader.tier_stats(NodeId(2), TierId(0)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (4, 0, 0));
    reader.release(leased.id).unwrap();
    // Leaving again: it was not alive; nothing changes.
    assert!(!index.leave(NodeId(2)).unwrap());
    assert!(!index.leave(NodeId(99)).unwrap(), "a node never seen");
    assert_eq!(reader.lookup(&[key(1)]).unwrap(), vec![Some(kept)]);

    // It comes back: empty, with its tier still registered, and the old placement never
    // matches again.
    announce(&index, NodeId(2), TTL);
    assert_eq!(alive(&reader), [NodeId(1), NodeId(2)]);
    let again = put(&index, key(5), &leaves);
    assert!(again.generation > gone.generation);
    assert_eq!(reader.lookup(&[key(2), key(5)]).unwrap(), vec![None, Some(again)]);
    assert_eq!(reader.lease(&[gone], TTL).unwrap().granted, vec![false]);
}

#[test]
fn a_node_that_leaves_is_gone_from_the_embedded_list() {
    let dir = tempfile::tempdir().unwrap();
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    let spec = TierSpec::new(NODE, TierId(0), 64, 4);
    setup(&index, &spec);
    announce(&index, NodeId(7), TTL);
    let p = put(&index, key(1), &spec);
    assert_eq!(alive(&index), [NODE, NodeId(7)]);
    assert!(index.leave(NodeId(7)).unwrap());
    assert_eq!(alive(&index), [NODE]);
    assert!(!index.leave(NodeId(7)).unwrap());
    // An announcement that already expired: not alive when it leaves.
    announce(&index, NodeId(8), Duration::from_millis(1));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!index.leave(NodeId(8)).unwrap());
    // The embedded index's blocks never depended on the announcement.
    assert!(index.leave(NODE).unwrap());
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![Some(p)]);
    assert!(alive(&index).is_empty());
}
