# ruff: noqa
# A wrong answer to labs/lab06_offload.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). Issue 40: the library's code. The step takes Adam's moments with the library's adam_step at a
# learning rate of 0 (it updates m and v in place and leaves the master as it is): the numbers are right, the guard
# names the call (and the log misses the moments). The prediction takes the host's master, m, v from offload_memory
# (less its full gradient shard): the numbers come out right, and the notebook's watch names the call. The
# budget's plan takes the parameters' bytes from it: every plan is right, and the check's profile hook names the call.
# EXPECT FAIL: serial, offload_bytes, budget

# ANSWER: serial
from parlab.schemes.zero.stages import adam_step


def offload_step(params, grads, state, link, lamb, t):
    buffer, units = state["staging"], state["units"]
    squares = torch.zeros(len(units), 2, dtype=torch.float64)
    for k, (g, st) in enumerate(zip(grads, units)):
        grad = buffer[: len(g)]
        link.to_host(g, grad).wait()
        adam_step(st["master"], grad, st["m"], st["v"], t, 0.0)
        squares[k, 0] = st["master"].square().sum()
        squares[k, 1] = lamb.direction(st["m"], st["v"], t).square().sum()
    dist.all_reduce(squares)
    for k, (p, st) in enumerate(zip(params, units)):
        w, u = squares[k].sqrt().tolist()
        lamb.update(st["master"], st["m"], st["v"], t, w / u)
        link.to_device(st["master"], p).wait()


def init_state(params, host, link, staging):
    area = host.zeros(staging)
    units = []
    for p in params:
        st = {name: host.zeros(p.numel()) for name in ("master", "m", "v")}
        link.to_host(p, st["master"]).wait()
        units.append(st)
    return {"units": units, "staging": area}


# PREDICT: offload_bytes
from parlab.schemes.zero.theory import offload_memory

numel = {name: p.numel() for name, p in build_lab_model(LabConfig()).named_parameters()}
offloaded = [n for name, n in numel.items() if ".attn.k." not in name and ".attn.v." not in name]
P = 683 + 342
staging_bytes = 8 * P
host_bytes = offload_memory(offloaded, 3, "cpu", 4, 8)["steady_total"]["host"] - 8 * 6887 + staging_bytes


# ANSWER: budget
from parlab.schemes.zero.theory import offload_memory


def plan_offload(numels, N, b_c, b_m, device_budget):
    shards = [math.ceil(n / N) for n in numels]
    room = device_budget - offload_memory(numels, N, "cpu", b_c, b_m)["steady_total"]["device"]
    if room < 0:
        raise ValueError("the parameters do not fit")
    reachable = {0: []}
    for k, S_u in enumerate(shards):
        for total, units in list(reachable.items()):
            if 4 * b_m * (total + S_u) <= room and total + S_u not in reachable:
                reachable[total + S_u] = units + [k]
    kept = set(reachable[max(reachable)])
    return ["device" if k in kept else "host" for k in range(len(shards))]
