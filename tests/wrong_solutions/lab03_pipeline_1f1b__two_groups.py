# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the library's way
# out, not the lab's: the gradients travel on a second process group, so that the two kinds never queue behind each
# other between two ranks. Every number is right, but the constraint was one group (with NCCL, a second communicator
# on every GPU): the check sees the receives and sends that ran on another group.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    grads = dist.new_group(list(range(dist.get_world_size())))
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
                comm.recv(grad, schedule.rank_of(s + 1), group=grads)
            grad_x = work.backward(a, grad)
            if s > 0:
                in_flight.append(comm.isend(grad_x, schedule.rank_of(s - 1), group=grads))
    comm.wait_all(in_flight)
