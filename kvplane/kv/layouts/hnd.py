"""HND GQA (head-major blocks, as NIXL's heterogeneous-TP path wants): k and v, each ``(nb, h, bs, d)``.

Inside a block all tokens of head 0 come first, so one head's slice of a block is contiguous. Everything but
the block shape is the split k/v layout's.
"""

from __future__ import annotations

from kvplane.kv.layouts.split_kv import SplitKV
from kvplane.kv.spec import SlotSpec


class HND(SplitKV):
    name = "hnd"
    shape = "k, v: (nb, h, bs, d)"
    order = "HND"

    def block_shape(self, slot: SlotSpec, tokens_per_block: int) -> tuple[int, int, int]:
        return (slot.heads, tokens_per_block, slot.head_dim)
