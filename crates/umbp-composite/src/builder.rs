//! The composite builder: one object scope over every engine's own builder.

use std::collections::HashMap;
use std::sync::Arc;

use umbp_plan::{
    EndpointId, EndpointTable, Error, Fragment, PlanBuilder, PlanSet, RejectReason, Tag,
};

use crate::metrics::direction;
use crate::route::{route, Route};
use crate::CompositeEngine;

/// A fragment that takes the staged route: two hops through the bounce region.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StagedFragment {
    /// The fragment as the caller pushed it.
    pub fragment: Fragment,
    /// Engine of the first hop.
    pub read: usize,
    /// Engine of the second hop.
    pub write: usize,
}

/// One engine's share of a batch.
#[derive(Debug)]
pub struct RoutedPart {
    /// The engine's position in the composite.
    pub engine: usize,
    /// The engine's plans, built by the engine's own builder.
    pub plans: PlanSet,
}

/// Everything a composite builder produced for one batch.
#[derive(Debug, Default)]
pub struct RoutedPlans {
    /// Each engine's plans, marked with the engine that made them.
    pub parts: Vec<RoutedPart>,
    /// Fragments for the staged route.
    pub staged: Vec<StagedFragment>,
    /// Every rejected object, from routing and from every engine's builder.
    pub rejected: Vec<Tag>,
}

impl RoutedPlans {
    /// Whether there is nothing to execute and nothing rejected.
    pub fn is_empty(&self) -> bool {
        self.parts.iter().all(|p| p.plans.plans().is_empty())
            && self.staged.is_empty()
            && self.rejected.is_empty()
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Scope {
    Closed,
    Open(Tag),
    Poisoned(Tag),
}

/// Routes each fragment to the first engine that claims its pair and pushes it into that
/// engine's own builder (created on first use), under one object scope: committing, rolling
/// back or rejecting an object does so in every engine it touched.
///
/// It keeps the [`PlanBuilder`] protocol (`begin_object`, `push`, `commit_object`,
/// `rollback_object`), and its [`finish`](Self::finish) returns every engine's plan set.
pub struct CompositeBuilder<'a> {
    composite: &'a CompositeEngine,
    table: Arc<EndpointTable>,
    subs: Vec<Option<Box<dyn PlanBuilder + Send + 'a>>>,
    /// Whether each sub-builder has the current object open.
    open_in: Vec<bool>,
    routes: HashMap<(EndpointId, EndpointId), Route>,
    /// The last pair routed, so that runs of one pair skip the map.
    last: Option<((EndpointId, EndpointId), Route)>,
    staged: Vec<StagedFragment>,
    staged_at_begin: usize,
    rejected: Vec<Tag>,
    rejected_at_begin: usize,
    scope: Scope,
}

impl<'a> CompositeBuilder<'a> {
    pub(crate) fn new(composite: &'a CompositeEngine) -> Self {
        let engines = composite.engines().len();
        Self {
            composite,
            table: composite.registry().snapshot(),
            subs: (0..engines).map(|_| None).collect(),
            open_in: vec![false; engines],
            routes: HashMap::new(),
            last: None,
            staged: Vec::new(),
            staged_at_begin: 0,
            rejected: Vec::new(),
            rejected_at_begin: 0,
            scope: Scope::Closed,
        }
    }

    /// Opens object `tag`.
    pub fn begin_object(&mut self, tag: Tag) -> Result<(), Error> {
        match self.scope {
            Scope::Open(open) | Scope::Poisoned(open) => Err(Error::ObjectOpen { open }),
            Scope::Closed => {
                self.scope = Scope::Open(tag);
                self.staged_at_begin = self.staged.len();
                self.rejected_at_begin = self.rejected.len();
                Ok(())
            }
        }
    }

    /// Routes and pushes one fragment of the open object. A fragment no engine claims, or one
    /// the claiming engine refuses, rejects the object in every engine.
    pub fn push(&mut self, f: Fragment) -> Result<(), Error> {
        if f.len == 0 {
            return Ok(());
        }
        let tag = match self.scope {
            Scope::Closed => return Err(Error::NoOpenObject),
            Scope::Poisoned(tag) => return Err(Error::ObjectRejected { tag }),
            Scope::Open(tag) if tag != f.tag => {
                return Err(Error::TagMismatch { object: tag, fragment: f.tag })
            }
            Scope::Open(tag) => tag,
        };
        let route = match self.last {
            Some((pair, route)) if pair == (f.src, f.dst) => route,
            _ => self.route(f.src, f.dst),
        };
        match route {
            Route::Direct(i) => {
                let sub = self.open_sub(i, tag)?;
                match sub.push(f) {
                    Err(Error::Rejected { reason, .. }) => {
                        Err(self.poison(tag, reason, &f, Some(i)))
                    }
                    other => other,
                }
            }
            Route::Staged { read, write } => match self.check_staged(&f) {
                Ok(()) => {
                    self.staged.push(StagedFragment { fragment: f, read, write });
                    Ok(())
                }
                Err(reason) => Err(self.poison(tag, reason, &f, None)),
            },
            Route::Unrouted => {
                let reason = match (self.table.get(f.src), self.table.get(f.dst)) {
                    (None, _) => RejectReason::UnknownEndpoint(f.src),
                    (_, None) => RejectReason::UnknownEndpoint(f.dst),
                    _ => RejectReason::PairNotHandled { src: f.src, dst: f.dst },
                };
                Err(self.poison(tag, reason, &f, None))
            }
        }
    }

    /// Commits the open object in every engine it touched.
    pub fn commit_object(&mut self) -> Result<(), Error> {
        if self.scope == Scope::Closed {
            return Err(Error::NoOpenObject);
        }
        for i in 0..self.subs.len() {
            if std::mem::take(&mut self.open_in[i]) {
                if let Some(sub) = self.subs[i].as_mut() {
                    sub.commit_object()?;
                }
            }
        }
        self.scope = Scope::Closed;
        Ok(())
    }

    /// Rolls the open object back in every engine it touched.
    pub fn rollback_object(&mut self) -> Result<(), Error> {
        if self.scope == Scope::Closed {
            return Err(Error::NoOpenObject);
        }
        self.rollback_subs()?;
        self.staged.truncate(self.staged_at_begin);
        self.rejected.truncate(self.rejected_at_begin);
        self.scope = Scope::Closed;
        Ok(())
    }

    /// Returns every engine's plans and all rejected tags, and leaves the builder ready for the
    /// next batch.
    pub fn finish(&mut self) -> Result<RoutedPlans, Error> {
        if let Scope::Open(open) | Scope::Poisoned(open) = self.scope {
            return Err(Error::ObjectOpen { open });
        }
        let mut out = RoutedPlans {
            parts: Vec::new(),
            staged: std::mem::take(&mut self.staged),
            rejected: std::mem::take(&mut self.rejected),
        };
        for (engine, sub) in self.subs.iter_mut().enumerate() {
            if let Some(sub) = sub.as_mut() {
                let plans = sub.finish()?;
                out.rejected.extend_from_slice(plans.rejected());
                if !plans.plans().is_empty() || !plans.rejected().is_empty() {
                    out.parts.push(RoutedPart { engine, plans });
                }
            }
        }
        self.staged_at_begin = 0;
        self.rejected_at_begin = 0;
        self.table = self.composite.registry().snapshot();
        Ok(out)
    }

    /// Hands a batch's buffers back to the engines' builders for the next batch.
    pub fn recycle(&mut self, plans: RoutedPlans) {
        for part in plans.parts {
            if let Some(Some(sub)) = self.subs.get_mut(part.engine) {
                sub.recycle(part.plans);
            }
        }
        let mut staged = plans.staged;
        if self.staged.is_empty() && staged.capacity() > self.staged.capacity() {
            staged.clear();
            self.staged = staged;
        }
    }

    fn route(&mut self, src: EndpointId, dst: EndpointId) -> Route {
        let route = match self.routes.get(&(src, dst)) {
            Some(&r) => r,
            None => {
                if self.table.get(src).is_none() || self.table.get(dst).is_none() {
                    self.table = self.composite.registry().snapshot();
                }
                let bounce = self.composite.bounce().and_then(|b| self.table.get(b)).copied();
                let r = match (self.table.get(src), self.table.get(dst)) {
                    (Some(s), Some(d)) => route(self.composite.engines(), bounce.as_ref(), s, d),
                    _ => Route::Unrouted,
                };
                // Unknown endpoints may be registered later: only cache known pairs.
                if r != Route::Unrouted {
                    self.routes.insert((src, dst), r);
                }
                r
            }
        };
        self.last = Some(((src, dst), route));
        route
    }

    /// Engine `i`'s builder with object `tag` open in it.
    fn open_sub(
        &mut self,
        i: usize,
        tag: Tag,
    ) -> Result<&mut Box<dyn PlanBuilder + Send + 'a>, Error> {
        let composite = self.composite;
        let sub = self.subs[i].get_or_insert_with(|| composite.engine_builder(i));
        if !self.open_in[i] {
            sub.begin_object(tag)?;
            self.open_in[i] = true;
        }
        Ok(sub)
    }

    /// Bounds of a staged fragment against both endpoints.
    fn check_staged(&self, f: &Fragment) -> Result<(), RejectReason> {
        for (id, offset) in [(f.src, f.src_offset), (f.dst, f.dst_offset)] {
            let e = self.table.get(id).ok_or(RejectReason::UnknownEndpoint(id))?;
            match offset.checked_add(f.len) {
                None => return Err(RejectReason::Overflow { endpoint: id, offset, len: f.len }),
                Some(end) if end > e.len() => {
                    return Err(RejectReason::OutOfBounds {
                        endpoint: id,
                        offset,
                        len: f.len,
                        endpoint_len: e.len(),
                    })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Rejects the open object everywhere: every engine it touched rolls it back, its staged
    /// fragments go, and its tag is rejected once, here.
    fn poison(
        &mut self,
        tag: Tag,
        reason: RejectReason,
        f: &Fragment,
        engine: Option<usize>,
    ) -> Error {
        let _ = self.rollback_subs();
        self.staged.truncate(self.staged_at_begin);
        self.rejected.push(tag);
        self.scope = Scope::Poisoned(tag);
        let name = engine.map_or("unrouted", |i| self.composite.engines()[i].name());
        let dir = match (self.table.get(f.src), self.table.get(f.dst)) {
            (Some(s), Some(d)) => direction(s, d),
            _ => "unknown".into(),
        };
        self.composite.metrics().record(name, dir, |c| c.rejected_fragments += 1);
        tracing::debug!(tag = tag.get(), %reason, "object rejected");
        Error::Rejected { tag, reason }
    }

    fn rollback_subs(&mut self) -> Result<(), Error> {
        let mut result = Ok(());
        for i in 0..self.subs.len() {
            if std::mem::take(&mut self.open_in[i]) {
                if let Some(sub) = self.subs[i].as_mut() {
                    result = result.and(sub.rollback_object());
                }
            }
        }
        result
    }
}
