# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The library's code called:
# mesh_group picks the rank's group out of parlab.core.mesh.axis_groups, which part 1 asks the student to write.
# Every group is right; the check sees the call and fails the part, naming it.
# EXPECT FAIL: groups

# ANSWER: groups
from parlab.core.mesh import axis_groups


def mesh_group(rank: int, axes: dict[str, int], axis: str) -> list[int]:
    return next(group for group in axis_groups(axes, axis) if rank in group)


def kv_group(rank: int, axes: dict[str, int], heads: int, kv_heads: int) -> list[int]:
    tp = mesh_group(rank, axes, "tp")
    T, t = len(tp), tp.index(rank)
    if T <= kv_heads:
        return [rank]
    share = T // kv_heads
    first = t // share * share
    return tp[first : first + share]
