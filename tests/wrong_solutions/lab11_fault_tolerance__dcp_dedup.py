# ruff: noqa
# A wrong answer to labs/lab11_fault_tolerance.ipynb (the other answers are the solution's). The bug: the writers
# chosen as torch.distributed.checkpoint's dedup_save_plans chooses them: every rank's items in turn, rank 0's
# first, each shared one to the holder with the least planned so far. That spreads the shared boxes, but decides
# each while most ranks' own boxes are not counted yet, and small boxes before big ones: on the lab model with
# M = 4 (and with 3 blocks) the busiest rank writes more than the best choice needs.
# EXPECT FAIL: tp_layout

# ANSWER: tp_layout
def tp_layout(name, shape, cfg, M, r):
    def box_of(name, shape, q):
        if len(shape) == 1:
            return ((0, shape[0]),)
        R, C = shape
        kind = name.split(".")[-2]
        hd, per = cfg.head_size, cfg.heads // M
        heads = (q * per * hd, (q + 1) * per * hd)
        if kind == "q":
            return (heads, (0, C))
        if kind == "o":
            return ((0, R), heads)
        if kind in ("k", "v"):
            group = cfg.heads // cfg.kv_heads
            first, last = q * per // group, ((q + 1) * per - 1) // group
            return ((first * hd, (last + 1) * hd), (0, C))
        if kind == "down":
            return ((0, R), (q * C // M, (q + 1) * C // M))
        return ((q * R // M, (q + 1) * R // M), (0, C))

    plans = tp_layout.__dict__.setdefault("plans", {})
    if (cfg, M) not in plans:
        params = [(n, list(p.shape)) for n, p in build_lab_model(cfg).named_parameters()]
        holders = {}  # (tensor, box) -> ranks, in the order the ranks' plans list them: rank 0's first
        for q in range(M):
            for n, s in params:
                holders.setdefault((n, box_of(n, s, q)), []).append(q)
        planned, plan = [0] * M, {}
        for (n, box), ranks in holders.items():
            q = min(ranks, key=lambda q: planned[q])
            plan[n, box] = q
            planned[q] += math.prod(b - a for a, b in box)
        plans[cfg, M] = plan
    box = box_of(name, shape, r)
    return box, plans[cfg, M][name, box] == r
