# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# receives in each sender's order, but treats the tip of a V like any other stage boundary: rank p - 1 holds stages
# p - 1 and p, and sends itself the activation (and the gradient back) through the process group. Every schedule
# with one chunk per rank, or interleaved chunks, passes; in ZB-V and DualPipeV the schedule has no such message,
# and gloo refuses it: rank p - 1 fails on its receive from itself.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1

    def sent_by(q):
        out = []
        for a in schedule.actions[q]:
            s = schedule.stage(q, a.chunk)
            if a.op == "F" and s < last:
                out.append((schedule.rank_of(s + 1), "act", a.mb, s + 1))
            if a.op in ("B", "BI") and s > 0:
                out.append((schedule.rank_of(s - 1), "grad", a.mb, s - 1))
        return out

    inbox = {}
    for q in range(schedule.p):
        for to, kind, mb, s in sent_by(q):
            if to == rank:
                buffer = work.empty()
                inbox[(kind, mb, s)] = (buffer, comm.irecv(buffer, q))
    in_flight = []

    def take(kind, mb, s):
        buffer, handle = inbox.pop((kind, mb, s))
        handle.wait()
        return buffer

    for a in schedule.actions[rank]:
        s = schedule.stage(rank, a.chunk)
        if a.op == "F":
            x = work.first_input(a.mb) if s == 0 else take("act", a.mb, s)
            y = work.forward(a, x)
            if s < last:
                in_flight.append(comm.isend(y, schedule.rank_of(s + 1)))
        elif a.op == "BW":
            work.weight(a)
        else:
            grad = take("grad", a.mb, s) if s < last else None
            grad_x = work.backward(a, grad)
            if s > 0:
                in_flight.append(comm.isend(grad_x, schedule.rank_of(s - 1)))
    comm.wait_all(in_flight)
