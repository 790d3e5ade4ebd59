# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: textbook double buffering in the model's order, the gradients alternating between the two
# ends of the staging area. It works while two neighbours fit in 1024 numbers together; the SwiGLU matrices come
# three in a row (683 + 683 > 1024), so the next gradient lands on the one the moments are reading. The log shows
# the copy onto the unit's gradient before its moments.
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
        if k + 1 < len(grads):
            down = link.to_host(grads[k + 1], place(k + 1))
        lamb.moments(place(k), st["m"], st["v"], t)
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
