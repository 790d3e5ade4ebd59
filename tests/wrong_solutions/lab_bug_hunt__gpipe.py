# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (the other answers are the solution's). The bug: part 5 "fixed" by
# giving up 1F1B: every stage runs all m forwards, then all m backwards (GPipe's schedule). Nothing hangs, the tied
# gradient is summed, the loss and the parameters equal one device's and every message is sent once: but stage s
# holds the activations of all m micro-batches at once where 1F1B holds p - s, the memory the user chose 1F1B for.
# EXPECT FAIL: pipeline_m

# ANSWER: one_f_one_b
def one_f_one_b(stage, m: int) -> None:
    for _ in range(m):  # all the forwards
        stage.send_forward(stage.forward(stage.recv_forward()))
    for _ in range(m):  # then all the backwards
        stage.send_backward(stage.backward(stage.recv_backward()))
    tied = stage.tied_grad()
    if tied is not None:
        comm.all_reduce(tied, group=stage.tied_group)
