# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: a search,
# but over too few placements: every order of the axes tried as the order in which the GPUs of a node vary, the
# best kept. Each is a mixed-radix count, and when the sizes do not nest the least is none of them (dp 2 x tp 3 on
# nodes of 2: the straddling tp place's two GPUs must share a node, which no count of the axes in any order does).
# EXPECT FAIL: groups

# ANSWER: groups
def place_in_order(axes: dict[str, int], gpus: int, numbering: str, inner: list[str]) -> list:
    """The mesh with the GPUs counted node by node, the axes of `inner` varying fastest first."""
    world = math.prod(axes.values())
    nodes = world // gpus

    def rank_at(coords: dict[str, int]) -> int:
        gpu_index = 0  # the GPU's place when the GPUs are counted node by node
        for axis in reversed(inner):
            gpu_index = gpu_index * axes[axis] + coords[axis]
        node, gpu = divmod(gpu_index, gpus)
        return node * gpus + gpu if numbering == "block" else gpu * nodes + node  # the launcher's number for it

    def build(prefix: list[int]) -> list | int:  # nested lists, one level per axis, in the order of `axes`
        if len(prefix) == len(axes):
            return rank_at(dict(zip(axes, prefix)))
        return [build(prefix + [i]) for i in range(list(axes.values())[len(prefix)])]

    return build([])


def place(axes: dict[str, int], gpus: int, numbering: str, payload: dict[str, float]) -> list:
    """The mesh as nested lists in the order of `axes` ({name: size}): mesh[i][j]... the global rank at those
    coordinates, on nodes of `gpus` GPUs numbered "block" or "cyclic"; payload: bytes per rank and step by axis."""
    import itertools

    world = math.prod(axes.values())
    nodes = world // gpus
    heaviest_first = sorted(axes, key=lambda axis: -payload[axis])

    def spans(mesh) -> tuple:  # per axis, heaviest first: the nodes its groups span, added up
        grid = torch.tensor(mesh)
        node = (grid // gpus) if numbering == "block" else (grid % nodes)
        out = []
        for axis in heaviest_first:
            lines = node.movedim(list(axes).index(axis), -1).reshape(-1, axes[axis])
            out.append(sum(len(set(line.tolist())) for line in lines))
        return tuple(out)

    return min(
        (place_in_order(axes, gpus, numbering, list(order)) for order in itertools.permutations(axes)), key=spans
    )
