# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: every push is answered at once, a counted one too, so that nobody waits: a counted worker gets
# the version it has just computed on, computes on it again, and its second gradient counts for the same update. The
# check sees a pull sent while the worker's gradient waited for its update.
# EXPECT FAIL: backup

# ANSWER: backup
def backup_server(theta, workers, take, updates, lr):
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    version, sent, counted, running = 0, {}, [], set(workers)

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
        if sent[w] == version and version < updates:
            counted.append(g.clone())
            if len(counted) == take:
                adam_step(theta, torch.stack(counted).mean(dim=0), m, v, version + 1, lr)
                version += 1
                counted = []
        pull(w)  # answered at once, counted or not
    return theta
