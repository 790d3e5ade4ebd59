# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: each counted gradient is applied as it arrives, one Adam step of g / A each, as an
# asynchronous server would (for SGD the A steps of g / A add up to one step with the mean; for Adam they do not: its
# moments and its t see A updates). The messages keep every rule; the numbers are not the replay's.
# EXPECT FAIL: backup

# ANSWER: backup
def backup_server(theta, workers, take, updates, lr):
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    version, steps, sent, waiting, running = 0, 0, {}, [], set(workers)

    def pull(w):
        sent[w] = version if version < updates else -1
        comm.send(torch.cat([theta, theta.new_tensor([sent[w]])]), w)
        if sent[w] == -1:
            running.discard(w)

    for w in workers:
        pull(w)
    g = torch.empty_like(theta)
    while running:
        w = comm.recv(g, None)
        if sent[w] != version or version == updates:
            pull(w)
            continue
        steps += 1
        adam_step(theta, g / take, m, v, steps, lr)  # at once, a share of the mean
        waiting.append(w)
        if len(waiting) == take:
            version += 1
            for u in waiting:
                pull(u)
            waiting = []
    return theta
