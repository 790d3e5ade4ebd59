# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the textbook
# rule, the heaviest axis varied fastest within a node (then the next), taken for the least everywhere. It is the
# least when the sizes nest, and passes every live mesh; but with a tp of 3 on nodes of 2 (dp 2 x tp 3, tp heavier)
# a tp group must straddle two nodes, and counting the GPUs puts the straddling pieces of the two replicas on
# different nodes: the dp groups span 6 nodes where 5 is the least (tp place 2 of both replicas on one node).
# EXPECT FAIL: groups

# ANSWER: groups
def place(axes: dict[str, int], gpus: int, numbering: str, payload: dict[str, float]) -> list:
    """The mesh as nested lists in the order of `axes` ({name: size}): mesh[i][j]... the global rank at those
    coordinates, on nodes of `gpus` GPUs numbered "block" or "cyclic"; payload: bytes per rank and step by axis."""
    inner = sorted(axes, key=lambda axis: -payload[axis])  # the heaviest axis varies fastest within a node
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
