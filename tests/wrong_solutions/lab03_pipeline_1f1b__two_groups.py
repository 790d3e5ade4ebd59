# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the library's
# way out, not the lab's: the gradients travel on a second process group, so that the two kinds never queue behind
# each other between two ranks, and each message is received when its action needs it. Every number is right, but
# the constraint was one group (with NCCL, a second communicator on every GPU): the check sees the receives and
# sends that ran on another group.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    grads = dist.new_group(list(range(dist.get_world_size())))
    in_flight, in_hand = [], {}

    def take(kind, mb, s, src, group):
        if src == rank:
            return in_hand.pop((kind, mb, s))
        buffer = work.empty()
        comm.recv(buffer, src, group=group)
        return buffer

    def hand_on(kind, mb, s, tensor, group):
        if schedule.rank_of(s) == rank:
            in_hand[(kind, mb, s)] = tensor
        else:
            in_flight.append(comm.isend(tensor, schedule.rank_of(s), group=group))

    for a in schedule.actions[rank]:
        s = schedule.stage(rank, a.chunk)
        if a.op == "F":
            x = work.first_input(a.mb) if s == 0 else take("act", a.mb, s, schedule.rank_of(s - 1), None)
            y = work.forward(a, x)
            if s < last:
                hand_on("act", a.mb, s + 1, y, None)
        elif a.op == "BW":
            work.weight(a)
        else:
            grad = take("grad", a.mb, s, schedule.rank_of(s + 1), grads) if s < last else None
            grad_x = work.backward(a, grad)
            if s > 0:
                hand_on("grad", a.mb, s - 1, grad_x, grads)
    comm.wait_all(in_flight)
