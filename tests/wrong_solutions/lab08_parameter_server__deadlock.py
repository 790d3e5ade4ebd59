# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: after each gradient the server only asks whether the worker that just pushed may go on; a
# worker held back is never looked at again, so once every worker is held the server waits for a gradient nobody
# will send. The launch is stopped after the lab's 15 s (issue 40: it took 60 s), naming what each rank waits in.
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
            if pushes[w] - min(pushes[u] for u in alive) <= s:  # only the worker that pushed
                comm.send(theta, w)
                read[w] = version
    return theta
