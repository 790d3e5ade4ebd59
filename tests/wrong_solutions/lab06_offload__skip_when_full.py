# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: double buffering in the model's order that gives up where two neighbours do not fit in the
# staging area together: there the next gradient is copied only after the moments, serially. Nothing is ever
# overwritten and the numbers are right, but the link idles during the moments of gate and up in every layer: an
# order of the moments in which every two neighbours fit exists, and LAMB allows any order.
# EXPECT FAIL: overlap

# ANSWER: overlap
def overlapped_step(params, grads, state, link, lamb, t):
    area, units = state["staging"], state["units"]
    P = len(area)

    def place(k):
        S = len(grads[k])
        return area[:S] if k % 2 == 0 else area[P - S :]

    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    down = link.to_host(grads[0], place(0))
    for k, st in enumerate(units):
        down.wait()
        fits = k + 1 < len(grads) and len(grads[k]) + len(grads[k + 1]) <= P
        if fits:
            down = link.to_host(grads[k + 1], place(k + 1))
        lamb.moments(place(k), st["m"], st["v"], t)
        if not fits and k + 1 < len(grads):
            down = link.to_host(grads[k + 1], place(k + 1))
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
