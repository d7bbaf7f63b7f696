//! The Prometheus metrics a scraper reads, checked against the batches that produced them.

mod support;

use std::sync::Arc;

use support::wrapped::Wrapped;
use support::*;
use umbp_composite::{restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject};
use umbp_plan::{
    BatchState, EndpointRegistry, Fragment, ObjectState, Register, Tag, TransferEngine,
};

const PAGE: u64 = 4096;

/// The value of the sample `name{labels}` in `text` (labels in any order, others ignored);
/// `None` if no line has it.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
        let all = labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        (metric == name && all).then(|| value.parse().expect("a number"))
    })
}

#[test]
fn a_scrape_after_a_restore_counts_what_the_batch_moved() {
    let rig = Rig::new();
    let (objects, pages) = (8usize, 3usize);
    let size = pages as u64 * PAGE;
    let mut arena = pattern(objects * size as usize, 7);
    let arena_id = rig.host(&mut arena);
    let dev = rig.device(objects as u64 * size);
    let mut host_out = vec![POISON; objects * size as usize];
    let host_id = rig.host(&mut host_out);
    // Object o's page k sits at arena page o * pages + (k + 1) % pages.
    let tables: Vec<Vec<u64>> = (0..objects)
        .map(|o| (0..pages).map(|k| (o * pages + (k + 1) % pages) as u64 * PAGE).collect())
        .collect();
    // Even objects go whole to the device, odd ones to host memory; one more object asks for a
    // range past its destination and is rejected.
    let ranges: Vec<[ObjectRange; 1]> = (0..objects)
        .map(|o| {
            let dst = if o % 2 == 0 { dev.id } else { host_id };
            [ObjectRange::new(0, size, dst, o as u64 * size)]
        })
        .collect();
    let bad = [ObjectRange::new(0, size, host_id, objects as u64 * size)];
    let mut batch: Vec<ObjectTransfer> = (0..objects)
        .map(|o| {
            ObjectTransfer::new(
                100 + o as u64,
                PagedObject::new(arena_id, &tables[o], PAGE, size),
                &ranges[o],
            )
        })
        .collect();
    batch.push(ObjectTransfer::new(999, PagedObject::new(arena_id, &tables[0], PAGE, size), &bad));

    let report = restore(&mut rig.composite.builder(), &batch).unwrap();
    assert_eq!(report.object(999).unwrap().state, ObjectState::Rejected);
    assert_eq!(report.unsuccessful().count(), 1, "{report:?}");
    // Every byte of every object arrived.
    let device = rig.read_device(&dev);
    for (o, table) in tables.iter().enumerate() {
        let out: &[u8] = if o % 2 == 0 { &device } else { &host_out };
        for (k, &page) in table.iter().enumerate() {
            let at = (o * pages + k) * PAGE as usize;
            let from = page as usize;
            assert_eq!(out[at..at + PAGE as usize], arena[from..from + PAGE as usize], "{o}/{k}");
        }
    }

    let text = rig.composite.metrics_text();
    assert!(text.ends_with("# EOF\n"), "{text}");
    let half = (objects / 2) as f64;
    let host = rig.host.name().to_string();
    for (engine, direction) in [("hbm", "host->device"), (host.as_str(), "host->host")] {
        let labels = [("engine", engine), ("direction", direction)];
        assert_eq!(sample(&text, "umbp_transfer_bytes_total", &labels), Some(half * size as f64));
        assert_eq!(sample(&text, "umbp_transfer_objects_total", &labels), Some(half), "{text}");
        let segments = sample(&text, "umbp_transfer_segments_total", &labels).unwrap();
        assert!((half..=half * pages as f64).contains(&segments), "{segments} segments");
        let parts = sample(&text, "umbp_part_duration_seconds_count", &[("engine", engine)]);
        assert_eq!(parts, Some(1.0), "one part per engine: {text}");
    }
    let rejected = [("engine", host.as_str()), ("reason", "out_of_bounds")];
    assert_eq!(sample(&text, "umbp_rejected_objects_total", &rejected), Some(1.0), "{text}");
    assert_eq!(sample(&text, "umbp_batch_duration_seconds_count", &[]), Some(1.0));
    assert_eq!(sample(&text, "umbp_plan_duration_seconds_count", &[]), Some(1.0));
    // Every object with bytes to move settled once; the rejected one had none.
    let settled = sample(&text, "umbp_object_duration_seconds_count", &[]);
    assert_eq!(settled, Some(objects as f64));
    let outcome = |o| sample(&text, "umbp_objects_total", &[("outcome", o)]);
    assert_eq!((outcome("completed"), outcome("rejected")), (Some(objects as f64), Some(1.0)));
    assert_eq!(sample(&text, "umbp_batches_total", &[("outcome", "failed")]), Some(1.0));
    assert_eq!(sample(&text, "umbp_in_flight_batches", &[]), Some(0.0));
    assert_eq!(sample(&text, "umbp_in_flight_bytes", &[]), Some(0.0));
    // The snapshot reads the same counters.
    let snapshot = rig.composite.metrics_snapshot();
    let c = &snapshot[&("hbm".to_string(), "host->device".to_string())];
    assert_eq!((c.bytes, c.objects), (half as u64 * size, half as u64));
}

#[test]
fn failures_are_counted_by_engine_direction_and_cause() {
    let registry = EndpointRegistry::new();
    let refusing = Arc::new(CountingEngine::new(registry.clone(), true));
    let hbm = Arc::new(umbp_hbm::HbmEngine::new(
        Arc::new(umbp_hbm::SimDevice::new(1)),
        registry.clone(),
        umbp_hbm::HbmConfig::default(),
    ));
    let composite = CompositeEngine::new(registry, vec![refusing, hbm.clone()]);
    let src = composite.register_memory(vec![1u8; 3 * 4096]).unwrap();
    let dst = hbm.alloc_device(GPU, 3 * 4096).unwrap();
    let mut builder = composite.builder();
    for round in 0..2 {
        for t in 0..3u32 {
            let tag = Tag::new(t);
            builder.begin_object(tag).unwrap();
            let at = u64::from(t) * 4096;
            builder.push(Fragment::new(src.id(), at, dst.id(), at, 4096, tag)).unwrap();
            builder.commit_object().unwrap();
        }
        let batch = composite.submit(builder.finish().unwrap()).unwrap();
        assert_eq!(batch.wait().aggregate, BatchState::Failed, "round {round}");
    }
    let text = composite.metrics_text();
    let labels = [("engine", "refusing"), ("direction", "host->device"), ("cause", "not_accepted")];
    // One failed plan per batch (the three objects merge into one plan).
    assert_eq!(sample(&text, "umbp_transfer_failures_total", &labels), Some(2.0), "{text}");
    let failed = sample(&text, "umbp_object_failures_total", &[("cause", "not_accepted")]);
    assert_eq!(failed, Some(6.0), "{text}");
    assert_eq!(sample(&text, "umbp_objects_total", &[("outcome", "failed")]), Some(6.0));
    assert_eq!(sample(&text, "umbp_batches_total", &[("outcome", "failed")]), Some(2.0));
    let snapshot = composite.metrics_snapshot();
    assert_eq!(snapshot[&("refusing".to_string(), "host->device".to_string())].failures, 2);
}

#[test]
fn an_unmetered_batch_moves_its_bytes_and_counts_nowhere() {
    let registry = EndpointRegistry::new();
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite = CompositeEngine::new(registry, vec![host]);
    let src = composite.register_memory(vec![3u8; 4096]).unwrap();
    let dst = composite.register_memory(vec![0u8; 4096]).unwrap();
    let before = composite.metrics_text();
    let mut builder = composite.builder();
    builder.set_metered(false);
    builder.begin_object(Tag::new(0)).unwrap();
    builder.push(Fragment::new(src.id(), 0, dst.id(), 0, 4096, Tag::new(0))).unwrap();
    builder.commit_object().unwrap();
    let batch = composite.submit(builder.finish().unwrap()).unwrap();
    assert_eq!(batch.wait().aggregate, BatchState::Completed);
    drop(batch);
    assert_eq!(composite.metrics_text(), before, "a probe counted as traffic");
    // The next batch of the same builder counts again.
    builder.begin_object(Tag::new(0)).unwrap();
    builder.push(Fragment::new(src.id(), 0, dst.id(), 0, 4096, Tag::new(0))).unwrap();
    builder.commit_object().unwrap();
    let batch = composite.submit(builder.finish().unwrap()).unwrap();
    assert_eq!(batch.wait().aggregate, BatchState::Completed);
    let text = composite.metrics_text();
    assert_eq!(sample(&text, "umbp_transfer_bytes_total", &[]), Some(4096.0), "{text}");
    assert_eq!(sample(&text, "umbp_batch_duration_seconds_count", &[]), Some(1.0));
    drop(batch);
    assert_eq!(dst.deregister(), vec![3u8; 4096]);
}

/// Rejections no push gave are counted too: an object the caller rejects itself (its ranges
/// refused before any fragment: `unrouted`, reason `other`), objects a buffered builder
/// refuses only at `finish`, and objects lost with a builder that panicked (both under their
/// engine). Before, only a refused push counted, so these rejected objects were in
/// `umbp_objects_total{outcome="rejected"}` but in no engine's `umbp_rejected_objects_total`.
#[test]
fn rejections_the_caller_or_an_engine_gives_after_a_push_are_counted() {
    let registry = EndpointRegistry::new();
    let host: Arc<dyn TransferEngine> =
        Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite_of =
        |engine: Wrapped| CompositeEngine::new(registry.clone(), vec![Arc::new(engine)]);
    let wrap = |name| Wrapped::new(host.clone(), registry.clone(), name);
    // Summed over directions: a push's rejection has its pair's, a late one `unknown`.
    let rejected = |text: &str, engine: &str, reason: &str| -> f64 {
        let labels = [format!("engine=\"{engine}\""), format!("reason=\"{reason}\"")];
        text.lines()
            .filter(|l| l.starts_with("umbp_rejected_objects_total{"))
            .filter(|l| labels.iter().all(|label| l.contains(label.as_str())))
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
            .sum()
    };
    let plan = |composite: &CompositeEngine, lens: &[u64], metered: bool| {
        let src = composite.register_memory(vec![5u8; 4 * 8192]).unwrap();
        let dst = composite.register_memory(vec![0u8; 4 * 8192]).unwrap();
        let mut b = composite.builder();
        b.set_metered(metered);
        for (o, &len) in lens.iter().enumerate() {
            let (tag, at) = (Tag::new(o as u32), o as u64 * 8192);
            b.begin_object(tag).unwrap();
            match b.push(Fragment::new(src.id(), at, dst.id(), at, len, tag)) {
                Ok(()) => b.commit_object().unwrap(),
                Err(e) => b.reject_object(e).unwrap(),
            }
        }
        // The caller's own refusal of one more object, before any of its fragments.
        let tag = Tag::new(lens.len() as u32);
        b.begin_object(tag).unwrap();
        b.reject_object(umbp_plan::WalkError::ZeroLength.into()).unwrap();
        let report = composite.submit(b.finish().unwrap()).unwrap().wait();
        report.objects.iter().filter(|o| o.state == ObjectState::Rejected).count()
    };

    // A buffered builder refusing lengths that are multiples of 8 KiB, at finish.
    let refusing = composite_of(wrap("refusing").buffered_refusing(8192));
    assert_eq!(plan(&refusing, &[4096, 8192, 4096, 8192], true), 3);
    let text = refusing.metrics_text();
    assert_eq!(rejected(&text, "refusing", "misaligned"), 2.0, "{text}");
    assert_eq!(rejected(&text, "unrouted", "other"), 1.0, "{text}");
    let snapshot = refusing.metrics_snapshot();
    assert_eq!(snapshot[&("refusing".to_string(), "unknown".to_string())].rejected_objects, 2);
    assert_eq!(sample(&text, "umbp_objects_total", &[("outcome", "rejected")]), Some(3.0));

    // A builder that panics on object 2's push loses objects 0 and 1 with it.
    let panicky = composite_of(wrap("panicky").builder_panicking_on(2));
    assert_eq!(plan(&panicky, &[4096; 4], true), 4);
    let text = panicky.metrics_text();
    assert_eq!(rejected(&text, "panicky", "builder_panicked"), 3.0, "{text}");
    assert_eq!(rejected(&text, "unrouted", "other"), 1.0, "{text}");

    // An unmetered batch counts none of them.
    let quiet = composite_of(wrap("quiet").buffered_refusing(8192));
    let before = quiet.metrics_text();
    assert_eq!(plan(&quiet, &[8192, 4096], false), 2);
    assert_eq!(quiet.metrics_text(), before);
}
