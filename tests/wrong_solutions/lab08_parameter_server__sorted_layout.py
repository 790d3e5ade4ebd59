# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the worker lays each server's message out in the order of the tensors' names, sorted, while
# the server lays it out in the model's order. The sizes agree, so nothing breaks: the values land in the wrong
# tensors, and training goes wrong from the first pull.
# EXPECT FAIL: sharded

# ANSWER: sharded
def sharded_server(shard, workers, steps, lr):
    flat = torch.cat([t.reshape(-1) for t in shard.values()])
    grads = [torch.empty_like(flat) for _ in workers]
    for _ in range(steps):
        for w in workers:
            comm.send(flat, w)
        for w, g in zip(workers, grads, strict=True):
            comm.recv(g, w)
        flat = flat - lr * torch.stack(grads).mean(dim=0)
    for w in workers:
        comm.send(flat, w)
    out, offset = {}, 0
    for name, t in shard.items():
        out[name] = flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
    return out


def sharded_worker(model, rows, plan):
    params = dict(model.named_parameters())
    servers = sorted(set(plan.values()))
    owned = {j: sorted(n for n in params if plan[n] == j) for j in servers}  # by name: not the server's order

    def pull():
        for j in servers:
            shard = torch.empty(sum(params[n].numel() for n in owned[j]), dtype=torch.float64)
            comm.recv(shard, j)
            offset = 0
            with torch.no_grad():
                for n in owned[j]:
                    params[n].copy_(shard[offset : offset + params[n].numel()].view_as(params[n]))
                    offset += params[n].numel()

    losses = []
    for x, y in rows:
        pull()
        model.zero_grad(set_to_none=True)
        loss = lab_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        for j in servers:
            comm.send(torch.cat([params[n].grad.reshape(-1) for n in owned[j]]), j)
    pull()
    return losses
