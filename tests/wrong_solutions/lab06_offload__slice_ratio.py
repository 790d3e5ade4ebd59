# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: LAMB's trust ratio from the rank's own slice, ||W_r|| / ||u_r||, as if the slice were the
# tensor: no communication at all, every unit stepped in one pass. Each rank scales its slice by another ratio, so the
# parameters differ from one device's, and the log shows the ratio each update used.
# EXPECT FAIL: serial

# ANSWER: serial
def offload_step(params, grads, state, link, lamb, t):
    buffer = state["staging"]
    for p, g, st in zip(params, grads, state["units"]):
        grad = buffer[: len(g)]
        link.to_host(g, grad).wait()
        lamb.moments(grad, st["m"], st["v"], t)
        ratio = st["master"].norm() / lamb.direction(st["m"], st["v"], t).norm()
        lamb.update(st["master"], st["m"], st["v"], t, ratio)
        link.to_device(st["master"], p).wait()


def init_state(params, host, link, staging):
    area = host.zeros(staging)
    units = []
    for p in params:
        st = {name: host.zeros(p.numel()) for name in ("master", "m", "v")}
        link.to_host(p, st["master"]).wait()
        units.append(st)
    return {"units": units, "staging": area}
