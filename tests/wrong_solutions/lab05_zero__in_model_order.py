# ruff: noqa
# A wrong answer to labs/lab05_zero.ipynb (the other answers are the solution's). The bug: each tensor goes to the
# least loaded rank in the model's order, the way they come. The small ones placed early leave the large ones
# nowhere good to go: on 3 ranks the busiest owns 8,736 elements where 7,680 are possible (and 6,208 for 5,696 on 4
# ranks). Training, state and traffic are right for the owners it chose.
# EXPECT FAIL: owners

# ANSWER: owners
def assign_owners(numels, N):
    owners, loads = [], [0] * N
    for n in numels:
        q = loads.index(min(loads))
        owners.append(q)
        loads[q] += n
    return owners


def init_owned(params, owners):
    r = comm.group_rank()
    return {i: (torch.zeros_like(p), torch.zeros_like(p)) for i, (p, q) in enumerate(zip(params, owners)) if q == r}


def owner_step(params, owners, state, step, lr=LR):
    N, r = comm.group_size(), comm.group_rank()
    with torch.no_grad():
        for i, (p, q) in enumerate(zip(params, owners)):
            comm.reduce(p.grad, dst=q)
            if q == r:
                m, v = state[i]
                lamb_step(p, p.grad / N, m, v, step, lr)
            comm.broadcast(p.detach(), src=q)
