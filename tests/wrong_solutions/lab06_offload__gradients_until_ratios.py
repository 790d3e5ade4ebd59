# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: every gradient kept on the host until the trust ratios are known, in buffers allocated in the
# step and freed at its end, as if memory freed again did not count. For a moment the host holds a full gradient
# shard beside master, m and v: the check reads the most the host ever held.
# EXPECT FAIL: serial

# ANSWER: serial
def offload_step(params, grads, state, link, lamb, t):
    host = state["host"]
    units = state["units"]
    kept = [host.zeros(len(g)) for g in grads]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, (g, st) in enumerate(zip(grads, units)):
        link.to_host(g, kept[k]).wait()
        lamb.moments(kept[k], st["m"], st["v"], t)
        squares[k, 0] = st["master"].square().sum()
        squares[k, 1] = lamb.direction(st["m"], st["v"], t).square().sum()
    dist.all_reduce(squares)
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = squares[k].sqrt().tolist()
        lamb.update(st["master"], st["m"], st["v"], t, w / u)
        link.to_device(st["master"], p).wait()
    for buffer in kept:
        host.free(buffer)


def init_state(params, host, link, staging):
    area = host.zeros(staging)
    units = []
    for p in params:
        st = {name: host.zeros(p.numel()) for name in ("master", "m", "v")}
        link.to_host(p, st["master"]).wait()
        units.append(st)
    return {"units": units, "staging": area, "host": host}
