# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the library's host layout, a gradient buffer for every unit (a full gradient shard on the
# host) instead of the two staging buffers the host has room for. Everything is numerically right and every copy is
# in order; the host holds b_m S more than two buffers of the largest shard.
# EXPECT FAIL: serial, overlap

# ANSWER: serial
def init_state(params, host, link):
    units = []
    for p in params:
        st = {name: host.zeros(p.numel()) for name in ("master", "m", "v", "grad")}
        link.to_host(p, st["master"]).wait()
        units.append(st)
    return {"units": units, "staging": [st["grad"] for st in units]}


def offload_step(params, grads, state, link, adam, t):
    for p, g, st in zip(params, grads, state["units"]):
        link.to_host(g, st["grad"]).wait()
        adam(st["master"], st["grad"], st["m"], st["v"], t)
        link.to_device(st["master"], p).wait()


# ANSWER: overlap
def overlapped_step(params, grads, state, link, adam, t):
    units = state["units"]
    downs = [link.to_host(g, st["grad"]) for g, st in zip(grads, units)]
    ups = []
    for k, (p, st) in enumerate(zip(params, units)):
        downs[k].wait()
        adam(st["master"], st["grad"], st["m"], st["v"], t)
        ups.append(link.to_device(st["master"], p))
    for up in ups:
        up.wait()
