# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# sends with blocking sends. GPipe survives (no two neighbours ever send to each other at once), but in 1F1B's
# steady state rank r sends an activation to rank r + 1 while rank r + 1 sends a gradient to rank r: both wait for
# a receive that never comes, and the launcher stops them with its diagnosis of the send/recv mismatch.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    for a in schedule.actions[rank]:
        s = schedule.stage(rank, a.chunk)
        if a.op == "F":
            if s == 0:
                x = work.first_input(a.mb)
            else:
                x = work.empty()
                comm.recv(x, schedule.rank_of(s - 1))
            y = work.forward(a, x)
            if s < last:
                comm.send(y, schedule.rank_of(s + 1))
        else:
            grad = None
            if s < last:
                grad = work.empty()
                comm.recv(grad, schedule.rank_of(s + 1))
            grad_x = work.backward(a, grad)
            if s > 0:
                comm.send(grad_x, schedule.rank_of(s - 1))
