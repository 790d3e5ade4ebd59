# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: "the dp group" read as the ranks with the same dp coordinate, i.e. every rank of one
# replica, instead of the ranks that differ from this one on dp only (same stage, same TP slice). The memory
# answer finds a rank's stage from its pp group, so it goes wrong too.
# EXPECT FAIL: groups, memory

# ANSWER: groups
import math


def mesh_group(rank: int, axes: dict[str, int], axis: str) -> list[int]:
    world = math.prod(axes.values())

    def coordinate(r: int, name: str) -> int:
        names = list(axes)
        stride = math.prod(axes[n] for n in names[names.index(name) + 1 :])
        return r // stride % axes[name]

    return [r for r in range(world) if coordinate(r, axis) == coordinate(rank, axis)]
