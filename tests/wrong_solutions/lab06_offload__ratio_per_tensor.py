# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: one all-reduce per tensor, in one pass (moments, the tensor's two squared norms summed over
# the ranks, its update). The numbers and every ratio are right, but the step makes 21 collectives where one does:
# 21 latencies, and every rank waits for the slowest at every tensor.
# EXPECT FAIL: serial

# ANSWER: serial
def offload_step(params, grads, state, link, lamb, t):
    buffer = state["staging"]
    for p, g, st in zip(params, grads, state["units"]):
        grad = buffer[: len(g)]
        link.to_host(g, grad).wait()
        lamb.moments(grad, st["m"], st["v"], t)
        squares = torch.stack([st["master"].square().sum(), lamb.direction(st["m"], st["v"], t).square().sum()])
        dist.all_reduce(squares)
        w, u = squares.sqrt().tolist()
        lamb.update(st["master"], st["m"], st["v"], t, w / u)
        link.to_device(st["master"], p).wait()


def init_state(params, host, link, staging):
    area = host.zeros(staging)
    units = []
    for p in params:
        st = {name: host.zeros(p.numel()) for name in ("master", "m", "v")}
        link.to_host(p, st["master"]).wait()
        units.append(st)
    return {"units": units, "staging": area}
