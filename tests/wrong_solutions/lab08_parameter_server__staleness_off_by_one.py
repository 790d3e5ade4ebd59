# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the worst case of a gradient in flight is counted without its own worker's new gradient
# (max(version - r) + the gradients in flight BEFORE the reply, minus one), so a reply is sent when the worst order
# can make a gradient D + 1 stale. At D = 1 the server sends theta_0 to all three workers at once; the walk of its
# messages names that pull and the staleness it allows, whatever the timing.
# EXPECT FAIL: staleness

# ANSWER: staleness
def bounded_server(theta, steps, lr, D):
    N = dist.get_world_size() - 1
    pushes = dict.fromkeys(range(1, N + 1), 0)
    computing, waiting, version = {}, list(pushes), 0

    def release():
        for w in list(waiting):
            if pushes[w] < steps:
                worst = len(computing) - 1 + max((version - r for r in computing.values()), default=0)
                if worst > D:
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
