# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The library asked for
# what the part is about: parlab.schemes.pipeline.schedules.messages lists, for each (sender, receiver, kind), the
# messages in the order the sender sends them; the answer merges each pair's two kinds by the sender's action
# order and posts its receives in that order. Every number is right (the library's list is), but the order of
# the messages was the part's question: the check sees the call and names it.
# EXPECT FAIL: executor

# ANSWER: executor
from parlab.schemes.pipeline.schedules import messages


def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    inbox = {}
    for (src, dst, kind), (sent, _received) in sorted(messages(schedule).items()):
        if dst != rank:
            continue
        for mb, s in sent:  # the sender's position of each message: its action's index in its order
            stage = s - 1 if kind == "act" else s + 1
            index = next(
                i
                for i, a in enumerate(schedule.actions[src])
                if a.mb == mb
                and schedule.stage(src, a.chunk) == stage
                and (a.op == "F") == (kind == "act")
                and a.op != "BW"
            )
            inbox[(kind, mb, s)] = (index, src)
    handles = {}
    for key, (index, src) in sorted(inbox.items(), key=lambda item: (item[1][1], item[1][0])):
        buffer = work.empty()
        handles[key] = (buffer, comm.irecv(buffer, src))
    in_hand, in_flight = {}, []

    def take(kind, mb, s):
        if (kind, mb, s) in in_hand:
            return in_hand.pop((kind, mb, s))
        buffer, handle = handles.pop((kind, mb, s))
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
        elif a.op == "BW":
            work.weight(a)
        else:
            grad = take("grad", a.mb, s) if s < last else None
            grad_x = work.backward(a, grad)
            if s > 0:
                hand_on("grad", a.mb, s - 1, grad_x)
    comm.wait_all(in_flight)
