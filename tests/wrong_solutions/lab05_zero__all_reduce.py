# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the gradients are
# all-reduced (every rank gets the sum, as in data parallelism) and only then does the owner step and broadcast. The
# parameters come out right and each rank keeps only its own tensors' m and v, but every rank receives every
# gradient: the traffic is data parallelism's plus a broadcast.
# EXPECT FAIL: owners

# ANSWER: owners
def assign_owners(numels: list[int], N: int) -> list[int]:
    """The rank that owns each tensor (numels: the tensors' sizes, in order), the busiest rank owning as few
    elements as possible."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i])  # the largest first: they decide the balance
    bound = max(max(numels), math.ceil(sum(numels) / N))  # no assignment does better than this
    best, best_owners = math.inf, None
    owners, loads = [0] * len(numels), [0] * N

    def place(k: int) -> None:  # a depth-first search over the owner of each tensor, largest first
        nonlocal best, best_owners
        if k == len(order):
            best, best_owners = max(loads), owners.copy()  # better than the best so far (the cuts below ensure it)
            return
        i, tried = order[k], set()
        for q in sorted(range(N), key=lambda q: loads[q]):  # the least loaded first: the first leaf is greedy's
            if loads[q] in tried or loads[q] + numels[i] >= best:
                continue  # a rank as loaded as one tried is the same subtree; a load >= best cannot improve
            tried.add(loads[q])
            owners[i], loads[q] = q, loads[q] + numels[i]
            place(k + 1)
            loads[q] -= numels[i]
            if best == bound:
                return  # optimal: nothing can beat the bound

    place(0)
    return best_owners


def init_owned(params: list[torch.nn.Parameter], owners: list[int]):
    """This rank's optimizer state: Adam's m and v of each tensor it owns (the check counts the bytes it holds)."""
    r = comm.group_rank()
    return {i: (torch.zeros_like(p), torch.zeros_like(p)) for i, (p, q) in enumerate(zip(params, owners)) if q == r}


def owner_step(params: list[torch.nn.Parameter], owners: list[int], state, step: int, lr: float = LR) -> None:
    """One LAMB step: afterwards every rank's parameters are one device's after LAMB on the whole batch. p.grad: the
    gradient of this rank's rows; owners: assign_owners's; state: init_owned's; step: 1, 2, ..."""
    N, r = comm.group_size(), comm.group_rank()
    with torch.no_grad():
        for i, (p, q) in enumerate(zip(params, owners)):
            comm.all_reduce(p.grad)  # every rank gets the sum, as in data parallelism
            if q == r:
                m, v = state[i]
                lamb_step(p, p.grad / N, m, v, step, lr)  # the mean over ranks: the whole batch's gradient
            comm.broadcast(p.detach(), src=q)  # every rank: the owner's new tensor, in place
