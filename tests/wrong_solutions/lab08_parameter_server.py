# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the synchronous server applies each gradient as it arrives, N updates per step instead of
# one with the mean (lesson 08's "N x K updates" slip): it steps N times too far. The messages and their order are
# a synchronous server's; the parameters and the losses are not one device's.
# EXPECT FAIL: sync

# ANSWER: sync
def sync_server(theta, steps, lr):
    N = dist.get_world_size() - 1
    g = torch.empty_like(theta)
    for _ in range(steps):
        for w in range(1, N + 1):
            comm.send(theta, w)
        for w in range(1, N + 1):
            comm.recv(g, w)
            theta = theta - lr * g
    for w in range(1, N + 1):
        comm.send(theta, w)
    return theta
