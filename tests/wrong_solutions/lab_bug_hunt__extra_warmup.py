# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 5's hang "fixed"
# by one warm-up forward more (p - s instead of p - s - 1), so that every stage's steady state runs for m >= 1 and
# the extra receive always has a message to take. The tied gradient is summed. Nothing hangs, the loss and the
# parameters equal one device's, every message travels once: but stage s now holds p - s + 1 micro-batches'
# activations at once (for m large enough), one more than 1F1B's.
# EXPECT FAIL: pipeline_m

# ANSWER: one_f_one_b
def one_f_one_b(stage, m: int) -> None:
    warmup = min(stage.p - stage.s, m)
    for _ in range(warmup):
        stage.send_forward(stage.forward(stage.recv_forward()))
    x = stage.recv_forward() if m > warmup else None
    for i in range(m - warmup):
        grad = stage.send_forward_recv_backward(stage.forward(x))
        grad_x = stage.backward(grad)
        if i == m - warmup - 1:
            stage.send_backward(grad_x)
        else:
            x = stage.send_backward_recv_forward(grad_x)
    for _ in range(warmup):
        stage.send_backward(stage.backward(stage.recv_backward()))
    tied = stage.tied_grad()
    if tied is not None:
        comm.all_reduce(tied, group=stage.tied_group)
