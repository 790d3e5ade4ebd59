# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# receives each message when its action needs it, on the one group. Between two ranks, messages meet receives in
# posting order. With p >= 3 each direction between two ranks carries one kind only, in the order the receiver needs
# it, so this works; in the interleaved schedule on 2 ranks, rank 0 sends micro-batch 0's gradient to rank 1 before
# micro-batch 2's activation, while rank 1 needs that activation first: its forward silently computes on a gradient.
# No hang, no error, wrong gradients.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    in_flight = []
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
                in_flight.append(comm.isend(y, schedule.rank_of(s + 1)))
        else:
            grad = None
            if s < last:
                grad = work.empty()
                comm.recv(grad, schedule.rank_of(s + 1))
            grad_x = work.backward(a, grad)
            if s > 0:
                in_flight.append(comm.isend(grad_x, schedule.rank_of(s - 1)))
    comm.wait_all(in_flight)
