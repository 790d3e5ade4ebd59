# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the prediction counts the LM head's matrix as a parameter of its own, as in the untied model,
# although it is the embedding: one parameter, one gradient, all-reduced once. Its bucket is counted twice too.
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


model = checks_model()
plan = plan_in_order(model, arrival(True), 16 * 1024)  # rank 0's order: it computes up first
size = [sum(model.get_parameter(name).numel() * 8 for name in bucket) for bucket in plan]
size[-1] += model.embed.weight.numel() * 8  # "the head's matrix" as well, in the last bucket
exposed_bytes = size[-1]
held_back_bytes_rank0 = 0
held_back_bytes_rank1 = 2 * 16384  # up's bucket waits for gate's, in each block
