"""Plans: descriptor arrays ``(src_addr, dst_addr, length)`` built from block ids and regions."""

from kvplane.plan.local import block_copy_plan

__all__ = ["block_copy_plan"]
