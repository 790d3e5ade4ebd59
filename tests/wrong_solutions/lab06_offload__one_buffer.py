# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the overlap through ONE staging buffer. The next unit's gradient copy is issued into the
# buffer Adam is about to read for this unit: whether Adam sees this unit's gradient or the next one's depends on
# how fast the copy engine is (the numbers may even come out right). The log shows the copy into the buffer between
# the unit's own copy and its Adam.
# EXPECT FAIL: overlap

# ANSWER: overlap
def overlapped_step(params, grads, state, link, adam, t):
    buffer, units = state["staging"][0], state["units"]
    down = link.to_host(grads[0], buffer[: len(grads[0])])
    ups = []
    for k, (p, st) in enumerate(zip(params, units)):
        down.wait()
        if k + 1 < len(grads):
            down = link.to_host(grads[k + 1], buffer[: len(grads[k + 1])])
        adam(st["master"], buffer[: len(grads[k])], st["m"], st["v"], t)
        ups.append(link.to_device(st["master"], p))
    for up in ups:
        up.wait()
