# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the failed worker's NaN is not applied, but its clock still counts in the slowest: the bound
# is kept over every worker, dead or alive. Once the living workers are s clocks ahead of the one that failed, every
# reply is held for a gradient that never comes: the launch is stopped after the lab's 15 s and each bound's run gets
# a FAIL line naming what each rank waits in.
# EXPECT FAIL: ssp

# ANSWER: ssp
def ssp_server(theta, steps, lr, s):
    N = dist.get_world_size() - 1
    pushes = {w: 0 for w in range(1, N + 1)}
    read, held, alive, version = dict.fromkeys(pushes, 0), set(), set(pushes), 0
    for w in pushes:
        comm.send(theta, w)
    g = torch.empty_like(theta)
    while any(pushes[w] < steps for w in alive) or held:
        w = comm.recv(g, None)
        if not torch.isfinite(g).all():
            alive.discard(w)
        else:
            theta = theta - lr / (1 + version - read[w]) * g
            version += 1
            pushes[w] += 1
            held.add(w)
        slowest = min(pushes.values())  # the failed worker still counted
        for u in sorted(held):
            if pushes[u] - slowest <= s:
                comm.send(theta, u)
                read[u] = version
                held.discard(u)
    return theta
