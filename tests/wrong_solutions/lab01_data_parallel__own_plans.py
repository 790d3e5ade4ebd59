# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The naive prediction: each rank's buckets rebuilt from its own order, so on every rank each bucket
# starts the moment it is complete and nothing is held back. The exposed bytes are right (the tied matrix's bucket
# is last on every rank); but every rank all-reduces rank 0's plan, and on rank 1 (up's gradient first) the bucket
# of up waits for the bucket of gate in each block.
# EXPECT FAIL: step_traffic

# PREDICT: step_traffic
def arrival(up_first):
    model, order = checks_model(up_first), []
    names = {id(p): name for name, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
    x, y = checks.OVERLAP_BATCHES[0]
    lab_loss(model(x), y).backward()
    return order


def traffic(up_first):
    model, order = checks_model(up_first), arrival(up_first)
    plan = plan_in_order(model, order, 16 * 1024)  # this rank's own plan
    size = [sum(model.get_parameter(name).numel() * 8 for name in bucket) for bucket in plan]
    position = {name: i for i, name in enumerate(order)}
    complete = [max(position[name] for name in bucket) for bucket in plan]
    start = [max(complete[: k + 1]) for k in range(len(plan))]
    exposed = sum(s for s, k in zip(size, start) if k == len(order) - 1)
    return exposed, sum(s for s, c, k in zip(size, complete, start) if c < k)


exposed_bytes, held_back_bytes_rank0 = traffic(True)  # rank 0 computes up first
held_back_bytes_rank1 = traffic(False)[1]
