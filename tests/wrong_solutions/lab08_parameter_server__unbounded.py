# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the "bounded" server never holds a reply: it is lesson 08's asynchronous server, whatever s
# is, with the staleness-aware step. Its numbers replay exactly, but with s = 0 the first worker to push gets its
# next parameters before anyone else has pushed, and the check sees that reply break the rule (whatever the timing).
# EXPECT FAIL: ssp

# ANSWER: ssp
def ssp_server(theta, steps, lr, s):
    N = dist.get_world_size() - 1
    pushes = {w: 0 for w in range(1, N + 1)}
    read, alive, version = dict.fromkeys(pushes, 0), set(pushes), 0
    for w in pushes:
        comm.send(theta, w)
    g = torch.empty_like(theta)
    while any(pushes[w] < steps for w in alive):
        w = comm.recv(g, None)
        if not torch.isfinite(g).all():
            alive.discard(w)
        else:
            theta = theta - lr / (1 + version - read[w]) * g
            version += 1
            pushes[w] += 1
            comm.send(theta, w)
            read[w] = version
    return theta
