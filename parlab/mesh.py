"""A device mesh: the ranks arranged on named axes, with one process group per axis.

Hybrid parallelism combines schemes by giving each its own axis: with `DeviceMesh({"dp": 2, "tp": 2})` on 4
ranks, tensor parallelism all-reduces within a "tp" group and data parallelism within a "dp" group:

    rank = dp_index * 2 + tp_index          # the last axis varies fastest, so TP partners are neighbours
                                            # (on a real cluster: on the same node, on the fast links)
              tp=0   tp=1
    dp=0    rank 0  rank 1                  tp groups: {0, 1}, {2, 3}
    dp=1    rank 2  rank 3                  dp groups: {0, 2}, {1, 3}

`check_mesh(axes, world_size)` validates the shape before any process starts. Inside a rank, `DeviceMesh(axes)`
creates every group (every rank must create every group, in the same order: that is how torch.distributed.new_group
works) and keeps the ones this rank belongs to.
"""

from __future__ import annotations

import itertools
import math

import torch.distributed as dist


def check_mesh(axes: dict[str, int], world_size: int) -> None:
    """Raise a clear ValueError unless the axis sizes are positive and multiply to world_size."""
    if not axes:
        raise ValueError("a mesh needs at least one axis, e.g. {'dp': 4}")
    for name, size in axes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be a positive int")
    total = math.prod(axes.values())
    if total != world_size:
        shape = " x ".join(f"{name}={size}" for name, size in axes.items())
        raise ValueError(f"mesh {shape} = {total} ranks, but world_size={world_size}")


def mesh_coords(rank: int, axes: dict[str, int]) -> dict[str, int]:
    """The coordinates of `rank` on each axis (last axis fastest)."""
    coords = {}
    for name, size in reversed(list(axes.items())):
        coords[name] = rank % size
        rank //= size
    return dict(reversed(list(coords.items())))


def mesh_rank(coords: dict[str, int], axes: dict[str, int]) -> int:
    """The rank at these coordinates (inverse of mesh_coords)."""
    rank = 0
    for name, size in axes.items():
        rank = rank * size + coords[name]
    return rank


def axis_groups(axes: dict[str, int], axis: str) -> list[list[int]]:
    """Every group of ranks along `axis`: ranks that differ only in their `axis` coordinate."""
    others = [name for name in axes if name != axis]
    groups = []
    for fixed in itertools.product(*(range(axes[name]) for name in others)):
        base = dict(zip(others, fixed, strict=True))
        groups.append([mesh_rank({**base, axis: i}, axes) for i in range(axes[axis])])
    return groups


class DeviceMesh:
    """This rank's place on the mesh, and its process group along each axis."""

    def __init__(self, axes: dict[str, int]):
        check_mesh(axes, dist.get_world_size())
        self.axes = dict(axes)
        self.rank = dist.get_rank()
        self.coords = mesh_coords(self.rank, self.axes)
        self._groups, self._ranks = {}, {}
        for axis in self.axes:
            for ranks in axis_groups(self.axes, axis):
                group = dist.new_group(ranks)  # collective: every rank creates every group
                if self.rank in ranks:
                    self._groups[axis], self._ranks[axis] = group, ranks

    def group(self, axis: str):
        """The process group of this rank along `axis` (pass it as group= to parlab.comm)."""
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along `axis`, in axis order."""
        return self._ranks[axis]

    def size(self, axis: str) -> int:
        return self.axes[axis]

    def index(self, axis: str) -> int:
        """This rank's coordinate on `axis` (its rank within that axis' group)."""
        return self.coords[axis]

    def __repr__(self) -> str:
        where = ", ".join(f"{axis}={i}" for axis, i in self.coords.items())
        return f"DeviceMesh({self.axes}) at rank {self.rank} ({where})"
