# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the "overlapped" step waits for every copy right after issuing it, so the link and the host
# still take turns: the numbers, the ratios, the buffers and the bytes are right, but no copy is ever in flight
# during the moments or an update.
# EXPECT FAIL: overlap

# ANSWER: overlap
def overlapped_step(params, grads, state, link, lamb, t):
    buffer, units = state["staging"], state["units"]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, (g, st) in enumerate(zip(grads, units)):
        down = link.to_host(g, buffer[: len(g)])
        down.wait()
        lamb.moments(buffer[: len(g)], st["m"], st["v"], t)
        squares[k, 0] = st["master"].square().sum()
        squares[k, 1] = lamb.direction(st["m"], st["v"], t).square().sum()
    dist.all_reduce(squares)
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = squares[k].sqrt().tolist()
        lamb.update(st["master"], st["m"], st["v"], t, w / u)
        up = link.to_device(st["master"], p)
        up.wait()
