# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the textbook
# rule "tp inside a node, then dp, pp across" applied whatever the payloads say. Where dp moves more bytes than tp (as
# in this lab's own step at 8 rows, and in the pairs of 2 GPUs where only one axis fits in a node) its groups cross
# nodes that the heaviest axis should have kept.
# EXPECT FAIL: groups

# ANSWER: groups
def place(axes: dict[str, int], gpus: int, numbering: str, payload: dict[str, float]) -> list:
    """The mesh as nested lists in the order of `axes` ({name: size}): mesh[i][j]... the global rank at those
    coordinates, on nodes of `gpus` GPUs numbered "block" or "cyclic"; payload: bytes per rank and step by axis."""
    inner = sorted(axes, key=["tp", "dp", "pp"].index)  # tp fastest, always
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
