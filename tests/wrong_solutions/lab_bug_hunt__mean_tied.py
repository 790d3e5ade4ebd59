# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 5's hang fixed
# (the warm-up one forward shorter, so that every stage's steady state runs and takes the input it receives: a
# right fix, as good as guarding the receive), but the tied matrix's gradient still averaged over its two copies,
# as data parallelism averages replicas. The copies stay equal, yet each holds half the gradient one device
# computes for the tied matrix (its two uses' parts belong summed): the drift from step 2 on remains, for every m.
# EXPECT FAIL: pipeline_m

# ANSWER: one_f_one_b
def one_f_one_b(stage, m: int) -> None:
    warmup = min(stage.p - stage.s - 1, m - 1)
    for _ in range(warmup):
        stage.send_forward(stage.forward(stage.recv_forward()))
    x = stage.recv_forward()
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
        tied /= 2
