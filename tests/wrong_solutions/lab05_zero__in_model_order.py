# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: each tensor goes to the
# least loaded rank in the model's order, the way they come. The small ones placed early leave the large ones
# nowhere good to go: on 3 ranks the busiest owns 8,736 elements where 7,680 are possible (and 6,208 for 5,696 on 4
# ranks). Training, state and traffic are right for the owners it chose.
# EXPECT FAIL: owners

# ANSWER: owners
def assign_owners(numels: list[int], N: int) -> list[int]:
    owners, loads = [], [0] * N
    for n in numels:  # the model's order, the way they come
        q = loads.index(min(loads))
        owners.append(q)
        loads[q] += n
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
