# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: the owners of the
# classic greedy rule, the largest tensor first to the least loaded rank, which is optimal on the lab model and on
# many lists but not on all: on [5, 5, 4, 4, 3, 3, 3] over 3 ranks its busiest rank owns 11 where 9 are possible
# (5 + 4, 5 + 4, 3 + 3 + 3), and 704 for 608 on the 4-rank list. Training, state and traffic are right.
# EXPECT FAIL: owners

# ANSWER: owners
def assign_owners(numels: list[int], N: int) -> list[int]:
    owners, loads = [0] * len(numels), [0] * N
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):  # the largest first
        q = loads.index(min(loads))  # to the least loaded rank so far
        owners[i], loads[q] = q, loads[q] + numels[i]
    return owners


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
            comm.reduce(p.grad, dst=q)  # the owner gets the sum of the ranks' gradients
            if q == r:
                m, v = state[i]
                lamb_step(p, p.grad / N, m, v, step, lr)  # the mean over ranks: the whole batch's gradient
            comm.broadcast(p.detach(), src=q)  # every rank: the owner's new tensor, in place
