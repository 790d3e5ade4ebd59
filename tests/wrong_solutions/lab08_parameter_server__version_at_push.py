# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: a worker's next gradient is taken to be computed on the version current when it pushed (its
# own update just applied), not on the version it was sent, which for a held reply comes several updates later. Its
# replies keep the rule; its staleness, and so its steps lr / (1 + tau), are too large whenever a reply was held.
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
            read[w] = version  # when it pushed, not when its reply goes
            pushes[w] += 1
            held.add(w)
        slowest = min(pushes[u] for u in alive)
        for u in sorted(held):
            if pushes[u] - slowest <= s:
                comm.send(theta, u)
                held.discard(u)
    return theta
