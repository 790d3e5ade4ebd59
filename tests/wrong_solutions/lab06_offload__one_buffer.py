# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the overlap with every gradient at the front of the staging area. The next unit's gradient
# copy is issued onto the place the moments are about to read for this unit: whether they see this unit's gradient or the next one's depends
# on how fast the copy engine is (the numbers may even come out right). The log shows the copy into the buffer
# between the unit's own copy and its moments.
# EXPECT FAIL: overlap

# ANSWER: overlap
def overlapped_step(params, grads, state, link, lamb, t):
    buffer, units = state["staging"], state["units"]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    down = link.to_host(grads[0], buffer[: len(grads[0])])
    for k, st in enumerate(units):
        down.wait()
        if k + 1 < len(grads):
            down = link.to_host(grads[k + 1], buffer[: len(grads[k + 1])])
        lamb.moments(buffer[: len(grads[k])], st["m"], st["v"], t)
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
