"""What the scheduler side and the workers send each other every step. vLLM pickles these
between processes: both sides import them from this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..kvpool import RankRef


#: One block to move: (operation id, tier, slot, GPU block id).
Item = Tuple[int, str, int, int]


@dataclass
class UmbpConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    #: request id -> blocks to load into it.
    loads: Dict[str, List[Item]] = field(default_factory=dict)
    #: request id -> blocks to save from it.
    saves: Dict[str, List[Item]] = field(default_factory=dict)
    #: (operation id, DRAM slot, SSD slot) to copy down.
    demotions: List[Tuple[int, int, int]] = field(default_factory=list)
    #: finished requests whose blocks vLLM keeps until their saves landed (finished_sending).
    hold: List[str] = field(default_factory=list)
    #: requests preempted this step: their blocks are about to be reused.
    preempted: List[str] = field(default_factory=list)
    layerwise: bool = False
    #: With a pool: operation id -> what each rank does (its file, slot and checksum; see
    #: umbp.kvpool.RankRef), for every load and save of this step.
    pool: Dict[int, List[RankRef]] = field(default_factory=dict)
    #: With several KV cache groups: operation id -> the KV cache group whose block it moves
    #: (absent: group 0). A load item with slot -1 (operation 0) is a block that cannot be
    #: loaded (vLLM took less than the hit): it fails, and with it the request's load.
    groups: Dict[int, int] = field(default_factory=dict)


@dataclass
class UmbpWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: how many ranks completed (``ok``) or failed each operation;
    with a pool, the CRC32C each rank's completed save of it wrote (``checksums``: operation
    id -> rank -> checksum), which the scheduler publishes."""

    ok: Dict[int, int] = field(default_factory=dict)
    failed: Dict[int, int] = field(default_factory=dict)
    checksums: Dict[int, Dict[int, int]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "UmbpWorkerMetadata":
        out = UmbpWorkerMetadata(
            dict(self.ok), dict(self.failed), {op: dict(c) for op, c in self.checksums.items()}
        )
        if isinstance(other, UmbpWorkerMetadata):
            for op, n in other.ok.items():
                out.ok[op] = out.ok.get(op, 0) + n
            for op, n in other.failed.items():
                out.failed[op] = out.failed.get(op, 0) + n
            for op, c in other.checksums.items():
                out.checksums.setdefault(op, {}).update(c)
        return out
