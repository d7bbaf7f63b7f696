"""What one KV block is on one rank: its layers' pages, its slot in the tiers, and vLLM's
KV cache groups (:class:`_Layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


#: Slots start on this boundary in the tiers, so an SSD slot is aligned for O_DIRECT.
SLOT_ALIGN = 4096


@dataclass(frozen=True)
class _Layout:
    """What one block is on one rank: ``layers`` pages of ``page_bytes``, in the order of the
    KV cache group's layer names; ``slot_bytes`` is its slot in a tier (aligned).

    With several KV cache groups (vLLM's hybrid allocator), a block hash names one block per
    group, each an object of its own: this layout is group 0's, and ``groups`` holds every
    group's (each with ``window``: the tokens a sliding-window group attends back, None for
    full attention). Slots are sized for the largest group's object."""

    layer_names: Tuple[str, ...]
    page_bytes: int
    block_size: int
    num_blocks: int
    window: Optional[int] = None
    #: Tokens a sliding-window group keeps below its window (vLLM's extra_retained_tokens).
    retained: int = 0
    groups: Tuple["_Layout", ...] = ()

    @property
    def object_bytes(self) -> int:
        return len(self.layer_names) * self.page_bytes

    @property
    def slot_bytes(self) -> int:
        size = max([self.object_bytes] + [g.object_bytes for g in self.groups])
        return -(-size // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def all_groups(self) -> Tuple["_Layout", ...]:
        return self.groups or (self,)

    def first_kept(self, tokens: int) -> int:
        """The first block this group keeps once ``tokens`` tokens are computed: vLLM frees
        (and replaces by its null block) a sliding-window group's blocks wholly below the
        window of the next token; a full-attention group keeps every block."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.retained) // self.block_size

    @staticmethod
    def of(kv_cache_config: "KVCacheConfig") -> "_Layout":
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            return _Layout._hybrid(kv_cache_config)
        spec = groups[0].kv_cache_spec
        page = getattr(spec, "page_size_bytes", None)
        if not page or not getattr(spec, "block_size", None):
            raise NotImplementedError(
                f"UmbpConnector cannot store a {type(spec).__name__} KV cache"
            )
        return _Layout(
            tuple(groups[0].layer_names),
            int(page),
            int(spec.block_size),
            int(kv_cache_config.num_blocks),
        )

    @staticmethod
    def _hybrid(kv_cache_config: "KVCacheConfig") -> "_Layout":
        """Several KV cache groups (vLLM's hybrid allocator): full-attention and
        sliding-window groups of one block size. Mamba (SSM) groups and chunked local
        attention are refused (docs/VLLM.md, "vLLM features", says why)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        out = []
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            window: Optional[int] = None
            retained = 0
            if isinstance(spec, SlidingWindowSpec):
                window, retained = int(spec.sliding_window), int(spec.extra_retained_tokens)
            elif not isinstance(spec, FullAttentionSpec):
                raise NotImplementedError(
                    f"UmbpConnector stores full-attention and sliding-window KV cache groups; "
                    f"group {i} is a {type(spec).__name__} (its blocks are not the KV of a "
                    "prefix's tokens: docs/VLLM.md, 'vLLM features'); run without this "
                    "connector, or with --disable-hybrid-kv-cache-manager where the model "
                    "allows it"
                )
            page = getattr(spec, "page_size_bytes", None)
            if not page or not getattr(spec, "block_size", None):
                raise NotImplementedError(
                    f"UmbpConnector cannot store a {type(spec).__name__} KV cache"
                )
            out.append(
                _Layout(
                    tuple(group.layer_names),
                    int(page),
                    int(spec.block_size),
                    int(kv_cache_config.num_blocks),
                    window,
                    retained,
                )
            )
        sizes = sorted({g.block_size for g in out})
        if len(sizes) != 1:
            raise NotImplementedError(
                f"UmbpConnector needs one block size in every KV cache group; these have {sizes}"
            )
        return replace(out[0], groups=tuple(out))
