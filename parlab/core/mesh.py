"""A device mesh: the ranks arranged on named axes, with one process group per axis.

Hybrid parallelism combines schemes by giving each its own axis: with `DeviceMesh({"dp": 2, "tp": 2})` on 4
ranks, tensor parallelism all-reduces within a "tp" group and data parallelism within a "dp" group:

    rank = dp_index * 2 + tp_index          # the last axis varies fastest, so TP partners are neighbours
                                            # (on a real cluster: on the same node, on the fast links)
              tp=0   tp=1
    dp=0    rank 0  rank 1                  tp groups: {0, 1}, {2, 3}
    dp=1    rank 2  rank 3                  dp groups: {0, 2}, {1, 3}

`check_mesh(axes, world_size)` validates the shape before any process starts. Inside a rank, `DeviceMesh(axes)`
builds torch's DeviceMesh (`torch.distributed.device_mesh.init_device_mesh`), which creates one group per axis
(every rank must build the same mesh: creating a group is collective), and hands out this rank's groups.
`mesh_coords`, `mesh_rank`, `axis_groups` and `split_groups` compute the same layout without any process, for figures
and checks; `DeviceMesh.flatten` and `DeviceMesh.unflatten` build the groups of several axes at once, or of an axis
cut in two (the hybrid mesh's dp x cp gradient group, USP's ring x ulysses, the experts' edp x ep). Every process
group parlab's schemes use on a mesh is built here.
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


def axis_groups(axes: dict[str, int], *names: str) -> list[list[int]]:
    """Every group of ranks along the axis `names[0]`, or along several axes flattened into one (in mesh order,
    torch's DeviceMesh._flatten): the ranks that differ only in those coordinates, each group in axis order.

        axis_groups({"dp": 2, "tp": 2}, "tp")        -> [[0, 1], [2, 3]]
        axis_groups({"dp": 2, "cp": 2, "tp": 2}, "dp", "cp") -> [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    inside = [a for a in axes if a in names]
    others = [a for a in axes if a not in names]
    groups = []
    for fixed in itertools.product(*(range(axes[a]) for a in others)):
        base = dict(zip(others, fixed, strict=True))
        places = itertools.product(*(range(axes[a]) for a in inside))
        groups.append([mesh_rank({**base, **dict(zip(inside, p, strict=True))}, axes) for p in places])
    return groups


def split_groups(groups: list[list[int]], inner: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each group (ranks in axis order) seen as an outer x inner mesh, inner fastest (torch's DeviceMesh._unflatten):
    (the outer groups, the inner groups). split_groups([[0, 1, 2, 3]], 2) -> ([[0, 2], [1, 3]], [[0, 1], [2, 3]])."""
    inner_groups = [g[i : i + inner] for g in groups for i in range(0, len(g), inner)]
    outer_groups = [g[j::inner] for g in groups for j in range(inner)]
    return outer_groups, inner_groups


class DeviceMesh:
    """This rank's place on the mesh, and its process group along each axis: a thin teaching layer over
    torch.distributed.device_mesh (the mesh FSDP2, DTensor and torchtitan use), which creates the groups.

        mesh = DeviceMesh({"dp": 2, "tp": 2})      # collective: every rank builds the same mesh
        mesh.group("tp")                           # pass as group= to a building block or to parlab.core.comm
        mesh.index("dp"), mesh.size("dp")          # this rank's coordinate on an axis, the axis' size
        mesh.torch_mesh                            # the torch DeviceMesh itself

    Calls on an axis' group are recorded by parlab.core.comm with that axis' name (Event.axis), so a trace can be
    filtered per axis: `trace.select(axis="dp")`, `trace.bytes_per_rank(axis="dp")`.
    """

    def __init__(self, axes: dict[str, int], device_type: str | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        check_mesh(axes, dist.get_world_size())
        self.axes = dict(axes)
        self.rank = dist.get_rank()
        self.coords = mesh_coords(self.rank, self.axes)
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        # torch's layout is ours: ranks arange(world).view(shape), the last axis fastest.
        self.torch_mesh = init_device_mesh(device_type, tuple(self.axes.values()), mesh_dim_names=tuple(self.axes))
        # An axis as large as the world (the others all of size 1: ulysses 4 x ring 1, or every axis at world 1)
        # gets torch's default group, which bears no axis name, so its calls would be filed under no axis and a
        # check of that axis' bytes would read 0. Such an axis gets a group of its own, named after it.
        world = dist.get_world_size()
        self._groups = {
            axis: self._new_group([list(range(world))], f"mesh_{axis}")
            for axis, size in self.axes.items()
            if size == world
        }

    def group(self, axis: str):
        """The process group of this rank along `axis` (pass it as group= to parlab.core.comm)."""
        if axis in self._groups:
            return self._groups[axis]
        return self.torch_mesh.get_group(axis)

    def twin_group(self, axis: str):
        """A second process group with the same ranks as `group(axis)`: a separate channel, so that two kinds of
        point-to-point message between the same ranks never queue behind each other (the pipeline sends
        activations on one, gradients on the other). Collective: every rank calls it, in the same order."""
        return self._new_group(axis_groups(self.axes, axis), f"mesh_{axis}")

    def flatten(self, *names: str):
        """One process group over several axes at once (torch's DeviceMesh._flatten): the ranks that differ only on
        `names`, in mesh order. Named "mesh_<a>_<b>", so the trace records its calls on axis "a_b". Collective."""
        inside = [a for a in self.axes if a in names]
        return self._new_group(axis_groups(self.axes, *inside), "mesh_" + "_".join(inside))

    def unflatten(self, names: tuple[str, ...], inner: int, new_names: tuple[str, str]):
        """The axes `names` (flattened) cut into an outer x inner mesh, inner fastest (torch's
        DeviceMesh._unflatten): this rank's (outer, inner) groups, named "mesh_<outer>" and "mesh_<inner>" so the
        trace records their calls on those axes. Collective: every rank builds every group."""
        outer_groups, inner_groups = split_groups(axis_groups(self.axes, *names), inner)
        return self._new_group(outer_groups, f"mesh_{new_names[0]}"), self._new_group(
            inner_groups, f"mesh_{new_names[1]}"
        )

    @staticmethod
    def _new_group(groups: list[list[int]], name: str):
        """This rank's group among `groups` (every rank creates all of them: creating a group is collective)."""
        mine, _ = dist.new_subgroups_by_enumeration(groups, group_desc=name)
        return mine

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along `axis`, in axis order."""
        return dist.get_process_group_ranks(self.group(axis))

    def size(self, axis: str) -> int:
        return self.axes[axis]

    def index(self, axis: str) -> int:
        """This rank's coordinate on `axis` (its rank within that axis' group)."""
        return self.torch_mesh.get_local_rank(axis)

    def __repr__(self) -> str:
        where = ", ".join(f"{axis}={i}" for axis, i in self.coords.items())
        return f"DeviceMesh({self.axes}) at rank {self.rank} ({where})"
