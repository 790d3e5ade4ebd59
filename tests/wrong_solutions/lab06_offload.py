# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_grade_run.py grades it; the other answers are the
# solution's). The bug: the "overlapped" step waits for every copy right after issuing it, so the link and the host
# still take turns: the numbers, the buffers and the bytes are right, but no copy is ever in flight during an Adam.
# EXPECT FAIL: overlap

# ANSWER: overlap
def overlapped_step(params, grads, state, link, adam, t):
    buffer = state["staging"][0]
    for p, g, st in zip(params, grads, state["units"]):
        down = link.to_host(g, buffer[: len(g)])
        down.wait()
        adam(st["master"], buffer[: len(g)], st["m"], st["v"], t)
        up = link.to_device(st["master"], p)
        up.wait()
