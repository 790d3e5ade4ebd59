# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: no master weights on the host. Adam steps the device's parameter slice directly, with m and v on the
# host. In this float64 run the numbers are even right, but Adam ran on device memory, nothing is copied back, and
# the host holds a quarter less than ZeRO-Offload's state: the log shows it. The solution's overlapped step then
# finds no master weights in the state and fails on the ranks.
# EXPECT FAIL: serial, overlap

# ANSWER: serial
def init_state(params, host, link):
    return [{name: host.zeros(p.numel()) for name in ("m", "v", "grad")} for p in params]


def offload_step(params, grads, state, link, adam, t):
    for p, g, st in zip(params, grads, state):
        link.to_host(g, st["grad"]).wait()
        adam(p, st["grad"], st["m"], st["v"], t)
