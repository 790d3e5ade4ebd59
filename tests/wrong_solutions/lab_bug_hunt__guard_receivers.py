# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 5's hang "fixed"
# only where the diagnosis showed it: a stage skips the extra receive when its input would come from another stage,
# but stage 0 still asks its data loader for one micro-batch more than it runs. The tied gradient is summed, as it
# should be. Nothing hangs any more and m = 4 trains as on one device, yet for m < 4 stage 0 eats the first
# micro-batch of the next step: from step 2 on its inputs no longer match the last stage's targets.
# EXPECT FAIL: pipeline_m

# ANSWER: one_f_one_b
def one_f_one_b(stage, m: int) -> None:
    warmup = min(stage.p - stage.s - 1, m)
    for _ in range(warmup):
        stage.send_forward(stage.forward(stage.recv_forward()))
    x = stage.recv_forward() if m > warmup or stage.s == 0 else None
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
