# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: part 1 "fixed" by all-reducing after the FIRST micro-batch instead of the last (DDP's no_sync must wrap
# every micro-batch but the last). The traffic is one copy of the gradients, as the check expects, but the later
# micro-batches' gradients are added after the average, locally: the ranks' gradients differ from one device's and
# from each other.
# EXPECT FAIL: dp_accumulation

# ANSWER: train_step
def train_step(model: torch.nn.Module, x_r: torch.Tensor, y_r: torch.Tensor, M: int) -> None:
    P = comm.group_size()
    for i, (x_m, y_m) in enumerate(zip(x_r.chunk(M), y_r.chunk(M))):
        loss = lab_loss(model(x_m), y_m) / M
        loss.backward()
        if i == 0:
            for p in model.parameters():
                comm.all_reduce(p.grad)
                p.grad /= P
