# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: only the new gradient's worst case is counted (it can be overtaken by every gradient in
# flight: len(computing) <= D), not what the new one does to the gradients already in flight, which were computed on
# older versions. A gradient computed several updates ago then gets one more update ahead of it: the walk names the
# first reply that makes an older gradient able to exceed D.
# EXPECT FAIL: staleness

# ANSWER: staleness
def bounded_server(theta, steps, lr, D):
    N = dist.get_world_size() - 1
    pushes = dict.fromkeys(range(1, N + 1), 0)
    computing, waiting, version = {}, list(pushes), 0

    def release():
        for w in list(waiting):
            if pushes[w] < steps:
                if len(computing) > D:  # the newcomer's worst case only
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
