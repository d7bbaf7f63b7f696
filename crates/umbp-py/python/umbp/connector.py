"""A KV-connector-shaped adapter: the calls an inference server's KV connector makes, over a
paged KV layout kept in a DRAM arena and an SSD file.

The layout is ``(layers, blocks, block_bytes)``: the server's KV cache holds, for each layer,
``blocks`` blocks of ``block_bytes`` bytes, in one destination buffer per layer (device memory,
or any registered memory). A cached block is stored in the arena or the file as one *slot* of
``layers × block_bytes`` bytes, layer after layer. Loading a block restores it from its slot
into block ``b`` of every layer's buffer; layers are grouped (``layers_per_group``), and
:meth:`KVConnector.wait_for_layer` returns once the layer's group has landed while later groups
still move, so the forward pass of early layers overlaps the restore of later ones.

The call shape follows what servers use (vLLM's KV connectors, SGLang's HiCache):

- :meth:`~KVConnector.start_load` at the start of a step, non-blocking;
- :meth:`~KVConnector.wait_for_layer` before each layer's attention;
- :meth:`~KVConnector.save_layer` after each layer's forward, non-blocking;
- :meth:`~KVConnector.wait_for_save` at the end of the step;
- :meth:`~KVConnector.finished` to learn which loads and saves are done.

It is an example of real use, tested, not a dependency on any server.

One thread drives a connector at a time, as a server's forward pass does (it is not
thread-safe); threads that each need one share an :class:`~umbp.Engine` (which is) and give
each connector its own file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional, Sequence, Set, Tuple

from . import (
    Batch,
    Engine,
    Error,
    Object,
    FailureKind,
    ObjectResult,
    Range,
    Registration,
    State,
    TransferError,
    UnknownKeyError,
    crc32c_combine,
)


@dataclass
class _Save:
    """A key's save of this step: its new slot, the block it reads, the layers started and,
    for each layer whose offload completed, the checksum it reported (``None`` where the
    engine's checksum policy does not cover the tier)."""

    reg: Registration
    slot: int
    block: int
    started: Set[int] = field(default_factory=set)
    saved: Dict[int, Optional[int]] = field(default_factory=dict)


class KVConnector:
    """Loads and saves KV blocks between a server's per-layer buffers and two cache tiers.

    ``engine``: the :class:`~umbp.Engine`. ``layer_buffers``: one registration per layer, each
    holding at least ``blocks × block_bytes`` bytes. ``dram_slots`` and ``ssd_slots``: how many
    blocks each tier holds; the arena is allocated here, the file created at ``ssd_path``.
    """

    def __init__(
        self,
        engine: Engine,
        layer_buffers: Sequence[Registration],
        block_bytes: int,
        *,
        dram_slots: int,
        ssd_path: str,
        ssd_slots: int,
        layers_per_group: int = 8,
    ):
        import numpy as np  # the arena is a numpy array

        self.engine = engine
        self.layers = len(layer_buffers)
        self.block_bytes = block_bytes
        self.layers_per_group = max(1, layers_per_group)
        self.slot_bytes = self.layers * block_bytes
        self.buffers = list(layer_buffers)
        self.arena = np.zeros(dram_slots * self.slot_bytes, dtype=np.uint8)
        self.dram = engine.register(self.arena)
        # Exclusive: a second connector (or process) given the same file is refused here,
        # before anything of this one's could be overwritten by it.
        self.ssd = engine.register_file(
            ssd_path, 0, ssd_slots * self.slot_bytes, create=True, extend=True, exclusive=True
        )
        self.ssd_path = ssd_path
        # key -> (tier registration, slot, the block's CRC32C or None): the checksum a load
        # verifies (see `_block_checksum`).
        self.index: Dict[Hashable, Tuple[Registration, int, Optional[int]]] = {}
        self._free = {id(self.dram): list(range(dram_slots))[::-1], id(self.ssd): list(range(ssd_slots))[::-1]}
        self._load: Optional[Batch] = None
        self._load_on_stream = False
        self._load_keys: Dict[int, Hashable] = {}
        # (offload, layer, tag -> key) of the saves since wait_for_save
        self._saves: List[Tuple[Batch, int, Dict[int, Hashable]]] = []
        # key -> its save since wait_for_save: a layer counts only once the offload carrying
        # it completed.
        self._saving: Dict[Hashable, _Save] = {}
        # Slots replaced while a load was in flight: freed once it is over (it may read them).
        self._retired: List[Tuple[Registration, int]] = []
        self._loaded: Set[Hashable] = set()
        self._saved: Set[Hashable] = set()

    # -- the tiers -------------------------------------------------------------------------

    def group_of(self, layer: int) -> int:
        """The layer group ``layer`` belongs to."""
        return layer // self.layers_per_group

    def _slot_pages(self, slot: int) -> List[int]:
        base = slot * self.slot_bytes
        return [base + layer * self.block_bytes for layer in range(self.layers)]

    def place(self, key: Hashable, tier: str) -> Tuple[Registration, int]:
        """Reserves a slot for ``key`` in ``tier`` (``"dram"`` or ``"ssd"``)."""
        reg = self.dram if tier == "dram" else self.ssd
        free = self._free[id(reg)]
        if not free:
            raise Error(f"no free {tier} slot")
        return reg, free.pop()

    def _release(self, reg: Registration, slot: int) -> None:
        self._free[id(reg)].append(slot)

    def _publish(
        self, key: Hashable, reg: Registration, slot: int, checksum: Optional[int] = None
    ) -> None:
        """Makes ``key`` load from ``slot`` of ``reg`` (verified against ``checksum`` when one
        is known), retiring the slot it loaded from."""
        old = self.index.get(key)
        self.index[key] = (reg, slot, checksum)
        if old is not None:
            self._retire(old[0], old[1])

    def _forget(self, key: Hashable) -> None:
        """Drops ``key`` from the index and retires its slot."""
        place = self.index.pop(key, None)
        if place is not None:
            self._retire(place[0], place[1])

    def _block_checksum(self, layers: Dict[int, Optional[int]]) -> Optional[int]:
        """The CRC32C of a whole slot (every layer's page, in layer order) from the checksums
        its per-layer offloads reported: what a load of the block, one object over all its
        layers, verifies. ``None`` when a layer's is unknown (its tier is not checksummed)."""
        crc: Optional[int] = None
        for layer in range(self.layers):
            part = layers.get(layer)
            if part is None:
                return None
            crc = part if crc is None else crc32c_combine(crc, part, self.block_bytes)
        return crc

    def _retire(self, reg: Registration, slot: int) -> None:
        """Frees a replaced slot, or, while a load may still read it, once the load is over."""
        if self._load is None:
            self._release(reg, slot)
        else:
            self._retired.append((reg, slot))

    def store(self, key: Hashable, tier: str, data: bytes) -> None:
        """Puts a whole cached block (``layers × block_bytes`` bytes, layer after layer) into a
        slot of ``tier`` directly, as a cache that was filled earlier would hold it."""
        if len(data) != self.slot_bytes:
            raise ValueError(f"a block is {self.slot_bytes} bytes, got {len(data)}")
        reg, slot = self.place(key, tier)
        try:
            self.engine.write(reg, slot * self.slot_bytes, data)
        except BaseException:
            self._release(reg, slot)
            raise
        self._publish(key, reg, slot)

    # -- loading ---------------------------------------------------------------------------

    def start_load(self, requests: Sequence[Tuple[Hashable, int]], stream: Any = None) -> None:
        """Starts restoring cached blocks: each request is ``(key, block)``, block ``block`` of
        every layer's buffer receiving the cached block ``key``. Returns at once.

        ``stream``: the server's compute stream (a ``torch.cuda.Stream`` or raw handle): the
        device work is queued on it, and :meth:`wait_for_layer` returns as soon as the layer's
        group is queued there, so the layer's kernels launched next run after its bytes, with
        no host wait for the device.

        A key nothing is cached for raises :class:`~umbp.UnknownKeyError` (an
        :class:`~umbp.Error` and a ``KeyError``) before anything starts."""
        if self._load is not None:
            raise Error("a load is already in flight; wait for it first")
        objects = []
        keys = {}
        for tag, (key, block) in enumerate(requests):
            if key not in self.index:
                # Before anything started: the load is refused whole.
                raise UnknownKeyError(key)
            tier, slot, checksum = self.index[key]
            ranges = [
                Range(
                    layer * self.block_bytes,
                    self.block_bytes,
                    self.buffers[layer],
                    block * self.block_bytes,
                    self.group_of(layer),
                )
                for layer in range(self.layers)
            ]
            objects.append(
                Object(
                    tag,
                    tier,
                    self._slot_pages(slot),
                    self.block_bytes,
                    self.slot_bytes,
                    ranges,
                    checksum=checksum,
                )
            )
            keys[tag] = key
        self._load_keys = keys
        self._load = self.engine.start_restore(objects, stream=stream)
        self._load_on_stream = stream is not None

    def wait_for_layer(self, layer: int, timeout: Optional[float] = None) -> List[Hashable]:
        """Blocks until ``layer``'s group has landed (or, for a load on a stream, is queued
        there). Returns the keys whose load failed so far (their blocks in this layer hold no
        cached bytes); empty when all arrived. On a stream a failure may show only later: check
        :meth:`finished` before trusting a block for reuse."""
        load = self._load
        if load is None:
            return []
        group = self.group_of(layer)
        if self._load_on_stream:
            ready = load.wait_group_enqueued(group, timeout)
        else:
            ready = load.wait_group(group, timeout)
        if not ready:
            raise Error(f"layer {layer} did not land within {timeout} s")
        return [self._load_keys[t] for t, _ in self._failed_loads(load)]

    def wait_for_load(self, timeout: Optional[float] = None) -> List[Hashable]:
        """Blocks until the load in flight has settled: every byte landed or failed (on a
        stream, after the stream ran its device work), so :meth:`finished` reports it from
        now on. Returns the keys whose load failed; empty when all arrived or when no load is
        in flight."""
        load = self._load
        if load is None:
            return []
        if load.wait(timeout) is None:
            raise Error(f"the load did not settle within {timeout} s")
        return [self._load_keys[t] for t, _ in self._failed_loads(load)]

    @staticmethod
    def _failed_loads(load: Batch) -> List[Tuple[int, ObjectResult]]:
        report = load.report()
        failed = (State.REJECTED, State.FAILED, State.CANCELLED)
        return [(o.tag, o) for o in report.objects if o.state in failed]

    # -- saving ----------------------------------------------------------------------------

    def save_layer(self, layer: int, blocks: Sequence[Tuple[Hashable, int]], tier: str = "dram") -> None:
        """Starts writing ``layer``'s part of each block ``(key, block)`` from the layer's
        buffer into a slot for the key, reserved in ``tier`` on the key's first layer. A key
        already cached is saved into a new slot: its cached bytes stay loadable, untouched,
        until :meth:`wait_for_save` finds every layer of the new copy saved. Returns at once.

        A key names its content (a server's block hash): between two :meth:`wait_for_save`
        calls it is saved from one block, the first one given for it, and each of its layers
        once. A later ``(key, block)`` for a layer already started, or from another block, is
        skipped, so no two writes of one slot are ever in flight together and a key never
        loads as a mix of two blocks.

        If it raises (no free slot, a closed layer buffer), nothing of this call remains: the
        slots it reserved are free again and no layer of it counts as saved. An object the
        engine refuses does not raise: :meth:`wait_for_save` reports its key failed."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} is not one of the {self.layers} layers")
        objects: List[Object] = []
        keys: Dict[int, Hashable] = {}
        reserved: List[Hashable] = []
        started_here: List[_Save] = []
        started = None
        try:
            for key, block in blocks:
                save = self._saving.get(key)
                if save is None:
                    reg, slot = self.place(key, tier)
                    save = self._saving[key] = _Save(reg, slot, block)
                    reserved.append(key)
                elif save.block != block or layer in save.started:
                    continue  # in flight already, or another block under the same key
                save.started.add(layer)
                started_here.append(save)
                page = self._slot_pages(save.slot)[layer]
                ranges = [Range(0, self.block_bytes, self.buffers[layer], block * self.block_bytes)]
                tag = len(objects)
                objects.append(Object(tag, save.reg, [page], self.block_bytes, self.block_bytes, ranges))
                keys[tag] = key
            if objects:
                started = self.engine.start_offload(objects)
                self._saves.append((started, layer, keys))
        except BaseException:
            if started is not None:
                started.wait()  # it writes into the slots about to be freed
            for save in started_here:
                save.started.discard(layer)
            for key in reserved:
                save = self._saving.pop(key)
                self._release(save.reg, save.slot)
            raise

    def wait_for_save(self) -> List[Hashable]:
        """Waits for every save started since the last call. A key whose every layer was
        saved (its offload completed) becomes loadable from its new slot (the slot of what it
        held before is freed, once no load in flight may read it).
        Returns the keys whose save failed or missed a layer: their new slots are freed, and
        what was cached for them before stays loadable, untouched."""
        failed: Set[Hashable] = set()
        for batch, layer, keys in self._saves:
            for o in batch.wait().objects:
                key = keys[o.tag]
                if o.ok:
                    self._saving[key].saved[layer] = o.checksum
                else:
                    failed.add(key)
        self._saves = []
        for key, save in self._saving.items():
            if key in failed or len(save.saved) != self.layers:
                failed.add(key)
                self._release(save.reg, save.slot)
                continue
            self._publish(key, save.reg, save.slot, self._block_checksum(save.saved))
            self._saved.add(key)
        self._saving = {}
        return sorted(failed, key=repr)

    # -- completion ------------------------------------------------------------------------

    def finished(self) -> Tuple[Set[Hashable], Set[Hashable]]:
        """``(loaded, saved)``: keys whose load completed and keys saved since the last call.
        A load in flight is reported once it has fully settled.

        A key whose cached bytes failed their checksum (the slot no longer holds what was
        saved: :attr:`~umbp.FailureKind.CHECKSUM_MISMATCH`) is forgotten here and its slot
        freed, so it is a miss from now on rather than a load error every time."""
        if self._load is not None and self._load.done():
            report = self._load.wait()
            self._loaded |= {self._load_keys[o.tag] for o in report.objects if o.ok}
            for o in report.objects:
                if isinstance(o.error, TransferError) and o.error.kind == FailureKind.CHECKSUM_MISMATCH:
                    self._forget(self._load_keys[o.tag])
            self._load = None
            for place in self._retired:
                self._release(*place)
            self._retired = []
        loaded, saved = self._loaded, self._saved
        self._loaded, self._saved = set(), set()
        return loaded, saved

    def close(self) -> None:
        """Waits for what is in flight and releases the tiers (the file stays on disk)."""
        if self._load is not None:
            self._load.wait()
            self._load = None
        self.wait_for_save()
        self.dram.close()
        self.ssd.close()
