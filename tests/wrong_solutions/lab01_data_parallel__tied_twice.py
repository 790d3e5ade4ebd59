# ruff: noqa
# A wrong answer to labs/lab01_data_parallel.ipynb (tests/test_wrong_answers.py runs it; the other answers are the
# solution's). The bug: the prediction counts the LM head's matrix as a parameter of its own, as in the untied model,
# although it is the embedding: one parameter, one gradient, all-reduced once. Its bucket is counted twice too.
# EXPECT FAIL: step_traffic

# PREDICT: step_traffic
model = checks_model()
order, names = [], {id(p): name for name, p in model.named_parameters()}
for p in model.parameters():
    p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
x, y = checks.OVERLAP_BATCHES[0]
lab_loss(model(x), y).backward()
plan = plan_in_order(model, order, 40 * 1024)
bucket_bytes = [sum(model.get_parameter(name).numel() * 8 for name in bucket) for bucket in plan]
head = model.embed.weight.numel() * 8  # "the head's matrix" as well
allreduce_calls = len(plan)
allreduce_bytes = sum(bucket_bytes) + head
exposed_bytes = bucket_bytes[-1] + head
