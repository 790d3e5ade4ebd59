# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the bound read one clock too strict (a worker
# allowed s - 1 clocks ahead of the slowest living one): at s = 1 replies are held that SSP allows (the check sees them
# held); at s = 0 a worker waits for its own next gradient, every worker is held, and the server waits for a gradient
# nobody will send: the launch is stopped and that run gets a FAIL line.
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
        slowest = min(pushes[u] for u in alive)
        for u in sorted(held):
            if pushes[u] - slowest <= s - 1:
                comm.send(theta, u)
                read[u] = version
                held.discard(u)
    return theta
