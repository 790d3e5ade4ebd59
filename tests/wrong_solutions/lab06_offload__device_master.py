# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: no master weights on the host. The update steps the device's parameter slice directly, with
# m and v on the host. In this float64 run the numbers are even right, but the update ran on device memory, nothing
# is copied back, and the host holds a third less than ZeRO-Offload's state: the log shows it. The solution's
# overlapped step then finds no master weights in the state and fails on the ranks.
# EXPECT FAIL: serial, overlap

# ANSWER: serial
def init_state(params, host, link, staging):
    units = [{name: host.zeros(p.numel()) for name in ("m", "v")} for p in params]
    return {"units": units, "staging": host.zeros(staging)}


def offload_step(params, grads, state, link, lamb, t):
    buffer, units = state["staging"], state["units"]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, (p, g, st) in enumerate(zip(params, grads, units)):
        link.to_host(g, buffer[: len(g)]).wait()
        lamb.moments(buffer[: len(g)], st["m"], st["v"], t)
        squares[k, 0] = p.square().sum()
        squares[k, 1] = lamb.direction(st["m"], st["v"], t).square().sum()
    dist.all_reduce(squares)
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = squares[k].sqrt().tolist()
        lamb.update(p, st["m"], st["v"], t, w / u)
