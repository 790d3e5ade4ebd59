# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the slices' norms summed over the ranks, ||W_0|| + ||W_1|| + ||W_2||, instead of their
# squares: a norm is not additive over the pieces of a vector. One all-reduce, the right layout, the wrong ratio.
# EXPECT FAIL: serial

# ANSWER: serial
def offload_step(params, grads, state, link, lamb, t):
    buffer, units = state["staging"], state["units"]
    norms = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, (g, st) in enumerate(zip(grads, units)):
        grad = buffer[: len(g)]
        link.to_host(g, grad).wait()
        lamb.moments(grad, st["m"], st["v"], t)
        norms[k, 0] = st["master"].norm()
        norms[k, 1] = lamb.direction(st["m"], st["v"], t).norm()
    dist.all_reduce(norms)
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = norms[k].tolist()
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
