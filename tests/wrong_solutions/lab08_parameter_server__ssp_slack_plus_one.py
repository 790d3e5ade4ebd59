# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: "no more than s clocks ahead" read as the fast worker's finished steps minus the slowest's
# at most s, counted after the reply (s + 1 of slack): the parameters of a worker's step c lack the slowest worker's
# gradient of step c - s - 1. At s = 0 the fast workers start step 1 before the straggler has pushed step 0: the walk
# names that pull and the worker whose gradient it lacks, whatever the timing.
# EXPECT FAIL: ssp

# ANSWER: ssp
def ssp_server(theta, steps, lr, s):
    N = dist.get_world_size() - 1
    pushes = {w: 0 for w in range(1, N + 1)}
    read, held, version = {}, set(), 0
    for w in pushes:
        comm.send(theta, w)
        read[w] = 0
    g = torch.empty_like(theta)
    for _ in range(N * steps):
        w = comm.recv(g, None)
        theta = theta - lr / (1 + version - read[w]) * g
        version += 1
        pushes[w] += 1
        held.add(w)
        slowest = min(pushes.values())
        for u in sorted(held):
            if pushes[u] - slowest <= s + 1:
                comm.send(theta, u)
                read[u] = version
                held.discard(u)
    return theta
