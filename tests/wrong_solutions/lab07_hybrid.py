# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the launcher's
# numbering taken to be node by node whatever it is. With SLURM's cyclic numbering rank r sits on node r mod N, so
# the GPUs this placement meant for one node (its consecutive ranks) are spread over every node: the heaviest axis'
# groups cross nodes in every cyclic case.
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
        return node * gpus + gpu  # node by node, always  # the launcher's number for it

    def build(prefix: list[int]) -> list | int:  # nested lists, one level per axis, in the order of `axes`
        if len(prefix) == len(axes):
            return rank_at(dict(zip(axes, prefix)))
        return [build(prefix + [i]) for i in range(list(axes.values())[len(prefix)])]

    return build([])


def kv_groups(tp_ranks: list[int], heads: int, kv_heads: int) -> dict[int, list[int]]:
    """{K/V head j: the ranks of the tp group `tp_ranks` (global, in tp order) that hold a copy of it, in tp order}
    for a model of `heads` query heads on `kv_heads` K/V heads."""
    T = len(tp_ranks)
    holders = {j: [] for j in range(kv_heads)}
    for t, rank in enumerate(tp_ranks):
        first, last = t * heads // T, (t + 1) * heads // T - 1  # its query heads
        for j in range(first * kv_heads // heads, last * kv_heads // heads + 1):  # the K/V heads they read
            holders[j].append(rank)
    return holders
