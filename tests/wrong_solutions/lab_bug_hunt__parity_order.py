# ruff: noqa
# A wrong answer to labs/lab_bug_hunt.ipynb (tests/test_labs.py grades it; the other answers are the solution's).
# The bug: part 5's deadlock "fixed" by ordering the blocking calls by rank parity (even ranks send first, odd ranks
# receive first). The hang is gone and the gradients are right, but each exchange does one direction after the
# other: the check requires both directions in flight at once, and counts none.
# EXPECT FAIL: pipeline_deadlock

# ANSWER: exchanges
def send_forward_recv_backward(y, grad_y, next_rank):
    if comm.group_rank() % 2 == 0:
        comm.send(y, next_rank)
        comm.recv(grad_y, next_rank)
    else:
        comm.recv(grad_y, next_rank)
        comm.send(y, next_rank)


def send_backward_recv_forward(grad_x, x, prev_rank):
    if comm.group_rank() % 2 == 0:
        comm.send(grad_x, prev_rank)
        comm.recv(x, prev_rank)
    else:
        comm.recv(x, prev_rank)
        comm.send(grad_x, prev_rank)
