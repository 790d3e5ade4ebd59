# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the safe and simple answer, one worker computing at a time (every gradient fresh, tau = 0
# <= D): the guarantee holds and the numbers replay exactly, but replies are held that the bound allowed (at D = 1 two
# workers can compute at once from the start), and the check sees them held.
# EXPECT FAIL: staleness

# ANSWER: staleness
def bounded_server(theta, steps, lr, D):
    N = dist.get_world_size() - 1
    pushes = dict.fromkeys(range(1, N + 1), 0)
    computing, waiting, version = {}, list(pushes), 0

    def release():
        for w in list(waiting):
            if pushes[w] < steps:
                if computing:  # nobody else in flight, whatever D allows
                    continue
                computing[w] = version
            comm.send(theta, w)
            waiting.remove(w)

    release()
    g = torch.empty_like(theta)
    for _ in range(N * steps):
        w = comm.recv(g, None)
        del computing[w]
        theta = theta - lr * g
        version += 1
        pushes[w] += 1
        waiting.append(w)
        release()
    return theta
