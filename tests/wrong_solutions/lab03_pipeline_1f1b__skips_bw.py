# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# receives in each sender's order and runs BI as a backward, but skips BW: it receives nothing and sends nothing,
# so there seemed to be nothing for the executor to do. It passes 1F1B and the interleaved schedule; on ZB-H1, ZB-V
# and DualPipeV the ranks no longer run the schedule's actions, and the weight gradients of every split backward
# are missing.
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
            if to == rank and q != rank:
                buffer = work.empty()
                inbox[(kind, mb, s)] = (buffer, comm.irecv(buffer, q))
    in_hand, in_flight = {}, []

    def take(kind, mb, s):
        if (kind, mb, s) in in_hand:
            return in_hand.pop((kind, mb, s))
        buffer, handle = inbox.pop((kind, mb, s))
        handle.wait()
        return buffer

    def hand_on(kind, mb, s, tensor):
        if schedule.rank_of(s) == rank:
            in_hand[(kind, mb, s)] = tensor
        else:
            in_flight.append(comm.isend(tensor, schedule.rank_of(s)))

    for a in schedule.actions[rank]:
        s = schedule.stage(rank, a.chunk)
        if a.op == "F":
            x = work.first_input(a.mb) if s == 0 else take("act", a.mb, s)
            y = work.forward(a, x)
            if s < last:
                hand_on("act", a.mb, s + 1, y)
        elif a.op in ("B", "BI"):
            grad = take("grad", a.mb, s) if s < last else None
            grad_x = work.backward(a, grad)
            if s > 0:
                hand_on("grad", a.mb, s - 1, grad_x)
    comm.wait_all(in_flight)
