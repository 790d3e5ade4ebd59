# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the library's host layout, a gradient buffer for every unit (a full gradient shard on the
# host), so that every gradient is still there when the trust ratios are known: the moments and the updates then run
# unit by unit after one all-reduce (and the overlap needs no order: every gradient has its own place). Everything is numerically right and every copy is in order; the host holds
# b_m S where the staging area it was given (and ignored) should be.
# EXPECT FAIL: serial, overlap

# ANSWER: serial
def init_state(params, host, link, staging):
    units = []
    for p in params:
        st = {name: host.zeros(p.numel()) for name in ("master", "m", "v", "grad")}
        link.to_host(p, st["master"]).wait()
        units.append(st)
    return {"units": units, "staging": [st["grad"] for st in units]}


def offload_step(params, grads, state, link, lamb, t):
    units = state["units"]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, (g, st) in enumerate(zip(grads, units)):
        link.to_host(g, st["grad"]).wait()
        lamb.moments(st["grad"], st["m"], st["v"], t)
        squares[k, 0] = st["master"].square().sum()
        squares[k, 1] = lamb.direction(st["m"], st["v"], t).square().sum()
    dist.all_reduce(squares)
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = squares[k].sqrt().tolist()
        lamb.update(st["master"], st["m"], st["v"], t, w / u)
        link.to_device(st["master"], p).wait()


# ANSWER: overlap
def overlapped_step(params, grads, state, link, lamb, t):
    units = state["units"]
    downs = [link.to_host(g, st["grad"]) for g, st in zip(grads, units)]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, st in enumerate(units):
        downs[k].wait()
        lamb.moments(st["grad"], st["m"], st["v"], t)
        squares[k, 0] = st["master"].square().sum()
        squares[k, 1] = lamb.direction(st["m"], st["v"], t).square().sum()
    dist.all_reduce(squares)
    ups = []
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = squares[k].sqrt().tolist()
        lamb.update(st["master"], st["m"], st["v"], t, w / u)
        ups.append(link.to_device(st["master"], p))
    for up in ups:
        up.wait()
