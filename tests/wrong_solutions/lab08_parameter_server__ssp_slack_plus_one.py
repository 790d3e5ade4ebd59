# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: "no more than s clocks ahead" read with
# one clock too many (s + 1 of slack): at s = 0 the fast workers start step 1 before the straggler has pushed step 0:
# the walk names that pull and the living worker too far behind, whatever the timing.
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
            if pushes[u] - slowest <= s + 1:
                comm.send(theta, u)
                read[u] = version
                held.discard(u)
    return theta
