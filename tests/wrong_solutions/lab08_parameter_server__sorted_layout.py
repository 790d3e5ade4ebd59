# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the worker lays each shard's message out in the order of the tensors' names, sorted, while
# the server lays it out in the model's order. The sizes agree, so nothing breaks: the values land in the wrong
# tensors, and training goes wrong from the first pull, in every run.
# EXPECT FAIL: sharded

# ANSWER: sharded
def sharded_server(
    shard: dict[str, torch.Tensor],
    backup: dict[str, torch.Tensor],
    servers: int,
    workers: list[int],
    steps: int,
    lr: float,
    failure: tuple[int, int] | None,
) -> dict[str, torch.Tensor]:
    me = dist.get_rank()
    after, before = (me + 1) % servers, (me - 1) % servers  # my backup; the server I back up
    F, t = failure if failure is not None else (None, steps + 1)

    def alive(j: int, step: int) -> bool:
        return j != F or step < t

    def state(tensors: dict[str, torch.Tensor]) -> dict:  # a shard's parameters [Psi_j], Adam's m, v and t
        theta = torch.cat([p.reshape(-1) for p in tensors.values()])
        return {"theta": theta, "m": torch.zeros_like(theta), "v": torch.zeros_like(theta), "t": 0, "like": tensors}

    serving, copy = {me: state(shard)}, state(backup)
    for step in range(steps + 1):  # step K: the last pull only
        if not alive(me, step):
            return {}
        if before == F and step == t:
            serving[F] = copy  # take over: the copy is exactly what server F held
        for w in workers:
            for j in sorted(serving):
                comm.send(serving[j]["theta"], w)  # the pull: one message per shard
        if step == steps:
            break
        mean = {}
        for j in sorted(serving):
            s = serving[j]
            grads = [torch.empty_like(s["theta"]) for _ in workers]
            for w, g in zip(workers, grads, strict=True):
                comm.recv(g, w)  # the push of shard j from w
            mean[j] = torch.stack(grads).mean(dim=0)
            s["t"] += 1
            adam_step(s["theta"], mean[j], s["m"], s["v"], s["t"], lr)
        # The mean gradient is all the backup needs to make the same Adam step: Psi_j numbers, not theta, m and v.
        sending = comm.isend(mean[me], after) if alive(after, step) else None  # a ring: do not block in it
        if alive(before, step):
            g = torch.empty_like(copy["theta"])
            comm.recv(g, before)
            copy["t"] += 1
            adam_step(copy["theta"], g, copy["m"], copy["v"], copy["t"], lr)
        if sending is not None:
            sending.wait()
    out = {}
    for s in serving.values():
        offset = 0
        for name, p in s["like"].items():
            out[name] = s["theta"][offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    return out


def sharded_worker(model: torch.nn.Module, rows: list, plan: dict[str, int], failure) -> list[float]:
    params = dict(model.named_parameters())
    servers = max(plan.values()) + 1
    F, t = failure if failure is not None else (None, len(rows) + 1)
    owned = {j: sorted(n for n in params if plan[n] == j) for j in range(servers)}  # by name: not the server's order

    def where(j: int, step: int) -> int:  # who serves shard j at this step
        return (j + 1) % servers if j == F and step >= t else j

    def pull(step: int) -> None:
        for j in range(servers):
            shard = torch.empty(sum(params[n].numel() for n in owned[j]), dtype=torch.float64)  # [Psi_j]
            comm.recv(shard, where(j, step))
            offset = 0
            with torch.no_grad():  # the pulled values become the model's parameters
                for n in owned[j]:
                    params[n].copy_(shard[offset : offset + params[n].numel()].view_as(params[n]))
                    offset += params[n].numel()

    losses = []
    for step, (x, y) in enumerate(rows):
        pull(step)
        model.zero_grad(set_to_none=True)
        loss = lab_loss(model(x), y)  # the mean over this worker's b rows
        loss.backward()
        losses.append(loss.item())
        for j in range(servers):
            comm.send(torch.cat([params[n].grad.reshape(-1) for n in owned[j]]), where(j, step))  # [Psi_j]
    pull(len(rows))
    return losses
    # END SOLUTION
