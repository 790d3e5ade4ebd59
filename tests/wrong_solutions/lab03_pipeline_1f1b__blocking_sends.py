# ruff: noqa
# A wrong answer to labs/lab03_pipeline_1f1b.ipynb (the other answers are the solution's). The bug: the executor
# sends with blocking sends. In 1F1B's steady state rank r sends an activation to rank r + 1 while rank r + 1 sends
# a gradient to rank r: both wait for a receive that never comes, and the launcher stops them with its diagnosis of
# the send/recv mismatch.
# EXPECT FAIL: executor

# ANSWER: executor
def execute(schedule, work):
    rank, last = dist.get_rank(), schedule.num_stages - 1
    in_hand = {}

    def take(kind, mb, s, src):
        if src == rank:  # the tip of a V, in memory
            return in_hand.pop((kind, mb, s))
        buffer = work.empty()
        comm.recv(buffer, src)
        return buffer

    def hand_on(kind, mb, s, tensor):
        if schedule.rank_of(s) == rank:
            in_hand[(kind, mb, s)] = tensor
        else:
            comm.send(tensor, schedule.rank_of(s))  # returns once the receiver has taken it

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
