//! Readiness on the device's own timeline: a caller's stream that device work of a batch is
//! queued on, and the listener told as each layer group is queued and as it lands.
//!
//! An inference server computes layer `k` on a stream of its own while the cache restores
//! layer `k + 1`. Waiting on the host for each layer's bytes would stall that stream's feeding
//! thread; instead the restore's device work is queued on a stream the server names
//! ([`DeviceStream`]), and the server's kernels for layer `k` are ordered after group `k`'s
//! copies by the stream itself, or, on another stream, by an event recorded there once the
//! group is queued ([`GroupListener::group_enqueued`]).

/// A device stream of the caller's, by its raw handle: a `CUstream` (CUDA), a `hipStream_t`
/// (HIP), as PyTorch hands it over (`torch.cuda.Stream.cuda_stream`), or any value on the
/// simulated device, which executes at once.
///
/// An engine that runs device work may queue a plan set's work for this device on the stream
/// instead of its own ([`PlanSet::set_stream`](crate::PlanSet::set_stream)); its transfer
/// handle then settles once the stream has reached the end of that work. Engines that do not
/// know streams ignore it and complete on the host before their handle settles, which orders
/// them before anything queued on the stream afterwards too.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct DeviceStream {
    device: crate::DeviceOrdinal,
    raw: u64,
}

impl DeviceStream {
    /// The stream `raw` of `device`. Handle `0` is the runtime's default (null) stream.
    ///
    /// # Safety
    ///
    /// `raw` is a stream of `device` in the runtime the device engine drives (the process's
    /// CUDA or HIP runtime), or any value for the simulated device, and it is not destroyed
    /// before every batch queued on it has settled: an engine hands it to the driver as is.
    #[allow(unsafe_code)] // Declares the obligation; umbp-plan never uses the handle.
    pub const unsafe fn new(device: crate::DeviceOrdinal, raw: u64) -> Self {
        Self { device, raw }
    }

    /// The device.
    pub const fn device(&self) -> crate::DeviceOrdinal {
        self.device
    }

    /// The raw handle.
    pub const fn raw(&self) -> u64 {
        self.raw
    }
}

/// Told as the layer groups of a batch are queued and as they land, in group order.
///
/// Group `k` is *enqueued* once every transfer of groups `0 ..= k` either finished on the
/// host or is queued on the batch's [stream](DeviceStream): work queued on that stream from
/// then on runs after group `k`'s bytes are in place. It is *settled* once those transfers
/// finished (or their objects failed or were cancelled), as the host sees it. A batch without
/// a stream, or whose engines all finish on the host, enqueues each group when it settles.
///
/// Both calls run on an executor thread that advanced the batch, after the batch's own state
/// shows the change, one call at a time per batch. Keep them short: a call holds up the
/// batch's later calls and, for its last group, the batch's end (a wait for the batch returns
/// only after every call). Uses: a server's per-layer counters
/// ([`group_settled`](Self::group_settled)), or an event recorded on the stream that another
/// stream waits on ([`group_enqueued`](Self::group_enqueued); the device engine's layer
/// events do this).
pub trait GroupListener: Send + Sync {
    /// Group `group` and every earlier one are queued; called once per group, in order, and
    /// never after [`group_settled`](Self::group_settled) for the same group. Default: nothing.
    fn group_enqueued(&self, group: u32) {
        let _ = group;
    }

    /// Group `group` and every earlier one settled; called once per group, in order.
    fn group_settled(&self, group: u32);
}
