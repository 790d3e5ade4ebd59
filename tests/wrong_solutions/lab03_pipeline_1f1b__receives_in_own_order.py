# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# receives each message when its action needs it, on the one group, and hands the tip of a V over in memory.
# Between two ranks, messages meet receives in posting order. With one stage per rank each direction carries one
# kind only, in the order the receiver needs it, so 1F1B and ZB-H1 work; in the interleaved schedule on 2 ranks,
# rank 0 sends micro-batch 0's gradient to rank 1 before micro-batch 2's activation, while rank 1 needs that
# activation first: its forward silently computes on a gradient. No hang, no error, wrong gradients.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    in_flight, in_hand = [], {}

    def take(kind, mb, s, src):
        if src == rank:
            return in_hand.pop((kind, mb, s))
        buffer = work.empty()
        comm.recv(buffer, src)
        return buffer

    def hand_on(kind, mb, s, tensor):
        if schedule.rank_of(s) == rank:
            in_hand[(kind, mb, s)] = tensor
        else:
            in_flight.append(comm.isend(tensor, schedule.rank_of(s)))

    for a in schedule.actions[rank]:
        s = schedule.stage(rank, a.chunk)
        if a.op == "F":
            x = work.first_input(a.mb) if s == 0 else take("act", a.mb, s, schedule.rank_of(s - 1))
            y = work.forward(a, x)
            if s < last:
                hand_on("act", a.mb, s + 1, y)
        elif a.op == "BW":
            work.weight(a)
        else:
            grad = take("grad", a.mb, s, schedule.rank_of(s + 1)) if s < last else None
            grad_x = work.backward(a, grad)
            if s > 0:
                hand_on("grad", a.mb, s - 1, grad_x)
    comm.wait_all(in_flight)
