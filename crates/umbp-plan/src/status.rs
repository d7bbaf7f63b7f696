//! Per-object results of a batch and its aggregate status.

use crate::{Error, Failure, Tag};

/// Where one object of a batch stands.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ObjectState {
    /// Not settled yet.
    InFlight,
    /// Every byte of the object arrived.
    Completed,
    /// Refused while planning: a bad range, page or fragment.
    Rejected,
    /// A transfer carrying its bytes failed.
    Failed,
    /// The batch was cancelled before all of the object's bytes arrived: transfers not yet
    /// started were skipped, and running ones either finished first or were stopped by an
    /// engine that cancels in flight (the SSD engine). The object's destination ranges may
    /// hold some of its bytes; nothing outside them was written.
    Cancelled,
}

impl ObjectState {
    /// Whether the state is final and not [`Completed`](Self::Completed).
    pub const fn is_unsuccessful(self) -> bool {
        matches!(self, Self::Rejected | Self::Failed | Self::Cancelled)
    }
}

/// The aggregate of a batch.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BatchState {
    /// Some object is still in flight.
    InFlight,
    /// Every object completed.
    Completed,
    /// Nothing is in flight any more and at least one object did not complete.
    Failed,
}

/// Per-object results for a batch of objects tagged `0 .. n`.
///
/// A failure is final: once an object is rejected or failed, a later completion does not revive
/// it. The aggregate is [`BatchState::Completed`] only when every object completed, and
/// [`BatchState::Failed`] only once nothing is still in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    states: Vec<ObjectState>,
    in_flight: usize,
    completed: usize,
}

impl BatchStatus {
    /// A batch of `objects` objects, all in flight. Takes a byte per object; see
    /// [`try_new`](Self::try_new) for counts that come from input.
    pub fn new(objects: usize) -> Self {
        Self { states: vec![ObjectState::InFlight; objects], in_flight: objects, completed: 0 }
    }

    /// [`new`](Self::new), or an error instead of an abort when the byte per object cannot be
    /// allocated: what a count from a caller (a batch of 2^32 objects) needs.
    pub fn try_new(objects: usize) -> Result<Self, std::collections::TryReserveError> {
        let mut states = Vec::new();
        states.try_reserve_exact(objects)?;
        states.resize(objects, ObjectState::InFlight);
        Ok(Self { states, in_flight: objects, completed: 0 })
    }

    /// Number of objects.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether the batch has no objects.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Records a new state for object `tag`. Rejected, failed and cancelled are final;
    /// completed only replaces in flight.
    pub fn set(&mut self, tag: Tag, state: ObjectState) -> Result<(), Error> {
        let objects = self.states.len();
        let slot = self.states.get_mut(tag.index()).ok_or(Error::UnknownTag { tag, objects })?;
        let old = *slot;
        let replace = match (old, state) {
            (ObjectState::Rejected | ObjectState::Failed | ObjectState::Cancelled, _) => false,
            (ObjectState::Completed, ObjectState::Completed | ObjectState::InFlight) => false,
            _ => old != state,
        };
        if replace {
            self.in_flight -= usize::from(old == ObjectState::InFlight);
            self.completed -= usize::from(old == ObjectState::Completed);
            self.in_flight += usize::from(state == ObjectState::InFlight);
            self.completed += usize::from(state == ObjectState::Completed);
            *slot = state;
        }
        Ok(())
    }

    /// Settles a batch after its handle was waited on: `rejected` tags are rejected, tags of
    /// `failures` failed, and every object still in flight completed.
    pub fn settle(&mut self, rejected: &[Tag], failures: &[Failure]) -> Result<(), Error> {
        for &tag in rejected {
            self.set(tag, ObjectState::Rejected)?;
        }
        for tag in failures.iter().flat_map(|f| &f.tags) {
            self.set(*tag, ObjectState::Failed)?;
        }
        for index in 0..self.states.len() {
            if self.states[index] == ObjectState::InFlight {
                self.set(Tag::new(index as u32), ObjectState::Completed)?;
            }
        }
        Ok(())
    }

    /// The state of object `tag`.
    pub fn object(&self, tag: Tag) -> Option<ObjectState> {
        self.states.get(tag.index()).copied()
    }

    /// Every object's state, indexed by tag.
    pub fn objects(&self) -> &[ObjectState] {
        &self.states
    }

    /// Objects that completed.
    pub fn completed_count(&self) -> usize {
        self.completed
    }

    /// Objects rejected, failed or cancelled.
    pub fn failed_count(&self) -> usize {
        self.states.len() - self.in_flight - self.completed
    }

    /// The aggregate state.
    pub fn aggregate(&self) -> BatchState {
        if self.in_flight > 0 {
            BatchState::InFlight
        } else if self.completed == self.states.len() {
            BatchState::Completed
        } else {
            BatchState::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EndpointId, FailureCause};

    fn failure(tags: &[u32]) -> Failure {
        Failure {
            engine: "test".into(),
            src: EndpointId::from_raw(0),
            dst: EndpointId::from_raw(1),
            tags: tags.iter().map(|&t| Tag::new(t)).collect(),
            cause: FailureCause::Io { errno: 5 },
        }
    }

    #[test]
    fn completed_only_when_every_object_completed() {
        let mut s = BatchStatus::new(3);
        assert_eq!(s.aggregate(), BatchState::InFlight);
        s.settle(&[], &[]).unwrap();
        assert_eq!(s.aggregate(), BatchState::Completed);
        assert_eq!(s.completed_count(), 3);
        assert_eq!(BatchStatus::new(0).aggregate(), BatchState::Completed);
    }

    #[test]
    fn failed_only_once_nothing_is_in_flight() {
        let mut s = BatchStatus::new(3);
        s.set(Tag::new(1), ObjectState::Failed).unwrap();
        assert_eq!(s.aggregate(), BatchState::InFlight, "objects 0 and 2 are still in flight");
        s.set(Tag::new(0), ObjectState::Completed).unwrap();
        assert_eq!(s.aggregate(), BatchState::InFlight);
        s.set(Tag::new(2), ObjectState::Completed).unwrap();
        assert_eq!(s.aggregate(), BatchState::Failed);
        assert_eq!((s.completed_count(), s.failed_count()), (2, 1));
    }

    #[test]
    fn settle_maps_rejections_and_failures_to_objects_and_failure_is_final() {
        let mut s = BatchStatus::new(4);
        s.settle(&[Tag::new(3)], &[failure(&[0, 2])]).unwrap();
        assert_eq!(
            s.objects(),
            &[
                ObjectState::Failed,
                ObjectState::Completed,
                ObjectState::Failed,
                ObjectState::Rejected
            ]
        );
        s.set(Tag::new(0), ObjectState::Completed).unwrap();
        assert_eq!(s.object(Tag::new(0)), Some(ObjectState::Failed));
        assert_eq!(s.aggregate(), BatchState::Failed);
    }

    #[test]
    fn a_tag_outside_the_batch_is_a_typed_error() {
        let mut s = BatchStatus::new(2);
        assert_eq!(
            s.set(Tag::new(2), ObjectState::Completed),
            Err(Error::UnknownTag { tag: Tag::new(2), objects: 2 })
        );
        assert_eq!(
            s.settle(&[], &[failure(&[7])]),
            Err(Error::UnknownTag { tag: Tag::new(7), objects: 2 })
        );
    }
}
