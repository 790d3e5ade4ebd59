# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: the "overlapped" step waits for every copy right after issuing it, so the link and the host still take
# turns: the numbers and the bytes are right, but no copy is ever in flight during an Adam call.
# EXPECT FAIL: overlap

# ANSWER: overlap
def overlapped_step(params, grads, state, link, adam, t):
    for p, g, st in zip(params, grads, state):
        down = link.to_host(g, st["grad"])
        down.wait()
        adam(st["master"], st["grad"], st["m"], st["v"], t)
        up = link.to_device(st["master"], p)
        up.wait()
