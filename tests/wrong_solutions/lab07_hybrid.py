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
    import functools
    import itertools

    sizes = list(axes.values())
    cells = list(itertools.product(*(range(n) for n in sizes)))  # every coordinate tuple, row-major
    heaviest_first = sorted(range(len(sizes)), key=lambda k: -payload[list(axes)[k]])

    def reach(node: tuple) -> tuple:  # per axis, heaviest first: how many of its groups have a GPU in this node
        return tuple(len({cells[i][:k] + cells[i][k + 1 :] for i in node}) for k in heaviest_first)

    @functools.cache
    def fill(left: tuple) -> tuple:  # the least spans (heaviest axis first) of the cells `left`, and their nodes
        if not left:
            return (0,) * len(sizes), ()
        options = []
        for mates in itertools.combinations(left[1:], gpus - 1):  # the first cell's node: any G - 1 of the others
            spans, nodes = fill(tuple(i for i in left[1:] if i not in mates))
            node = (left[0], *mates)  # the spans of the nodes add up: the rest is the same problem, smaller
            options.append((tuple(a + b for a, b in zip(reach(node), spans)), (node, *nodes)))
        return min(options)

    _, nodes = fill(tuple(range(len(cells))))
    count = len(cells) // gpus
    rank_of = {}
    for n, node in enumerate(nodes):
        for slot, cell in enumerate(node):  # the launcher's number for GPU `slot` of node n
            rank_of[cells[cell]] = n * gpus + slot  # node by node, always

    def build(prefix: list[int]) -> list | int:  # nested lists, one level per axis, in the order of `axes`
        if len(prefix) == len(sizes):
            return rank_of[tuple(prefix)]
        return [build(prefix + [i]) for i in range(sizes[len(prefix)])]

    return build([])
