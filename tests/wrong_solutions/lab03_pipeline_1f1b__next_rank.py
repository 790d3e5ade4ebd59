# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# sends to rank + 1 and rank - 1 instead of the rank that holds stage s + 1 or s - 1. With one stage per rank that
# is the same thing; in the interleaved schedule, rank p - 1's chunk 0 must send to rank 0 (stage p lives there),
# and in a V the stages after p - 1 go back up the ranks: there is no rank p, and rank p - 1 sends to no one beyond.
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
                comm.recv(x, rank - 1)
            y = work.forward(a, x)
            if s < last:
                in_flight.append(comm.isend(y, rank + 1))
        elif a.op == "BW":
            work.weight(a)
        else:
            grad = None
            if s < last:
                grad = work.empty()
                comm.recv(grad, rank + 1)
            grad_x = work.backward(a, grad)
            if s > 0:
                in_flight.append(comm.isend(grad_x, rank - 1))
    comm.wait_all(in_flight)
