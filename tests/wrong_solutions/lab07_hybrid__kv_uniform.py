# ruff: noqa
# A wrong answer to labs/lab07_hybrid.ipynb (the other answers are the solution's). The bug: the K/V heads dealt
# out over tp like the query heads (place t holds K/V heads [t nkv/T, (t+1) nkv/T), or one head on T/nkv
# consecutive places when T > nkv), right only when T divides nkv or nkv divides T. With 12 query heads on 3 K/V
# heads and T = 2, place 0's query heads 4 and 5 read K/V head 1, which this gives to place 1 alone: nobody sums its
# copies, the step's gradients are wrong and its traffic is not the theory's, and the plan's bytes (built on
# kv_groups) are off too.
# EXPECT FAIL: groups, step, traffic, plan

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


def kv_groups(tp_ranks: list[int], heads: int, kv_heads: int) -> dict[int, list[int]]:
    """{K/V head j: the ranks of the tp group `tp_ranks` (global, in tp order) that hold a copy of it, in tp order}
    for a model of `heads` query heads on `kv_heads` K/V heads."""
    T = len(tp_ranks)
    if T <= kv_heads:  # K/V heads split like the query heads: place t holds [t nkv/T, (t+1) nkv/T)
        place_of = [t for t in range(T) for _ in range(t * kv_heads // T, (t + 1) * kv_heads // T)]
        return {j: [tp_ranks[place_of[j]]] for j in range(kv_heads)}
    share = T // kv_heads  # one head on `share` consecutive places
    return {j: tp_ranks[j * share : (j + 1) * share] for j in range(kv_heads)}
