# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: "the dp group" read as the ranks with the same dp coordinate, i.e. every rank of one
# replica, instead of the ranks that differ from this one on dp only (same stage, same TP slice). kv_group builds on
# the tp group, so it goes wrong too, and so does the step, which creates its K/V groups from kv_group.
# EXPECT FAIL: groups, step, traffic

# ANSWER: groups
def mesh_group(rank: int, axes: dict[str, int], axis: str) -> list[int]:
    world = math.prod(axes.values())

    def coordinate(r: int, name: str) -> int:
        names = list(axes)
        stride = math.prod(axes[n] for n in names[names.index(name) + 1 :])
        return r // stride % axes[name]

    return [r for r in range(world) if coordinate(r, axis) == coordinate(rank, axis)]


def kv_group(rank: int, axes: dict[str, int], heads: int, kv_heads: int) -> list[int]:
    tp = mesh_group(rank, axes, "tp")
    T, t = len(tp), tp.index(rank)
    if T <= kv_heads:
        return [rank]
    share = T // kv_heads
    first = t // share * share
    return tp[first : first + share]
