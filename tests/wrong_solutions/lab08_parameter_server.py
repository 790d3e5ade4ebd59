# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: the backup-worker server counts the first A gradients that arrive, whatever version they were
# computed on (TensorFlow's first SyncReplicasOptimizer had to tag gradients with their step for this reason). A late
# gradient, computed on an older version, then makes part of the next update. The messages and the replies keep the
# rules; the replay of the rule (late gradients dropped) does not give the server's parameters.
# EXPECT FAIL: backup

# ANSWER: backup
def backup_server(theta, workers, take, updates, lr):
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    version, counted, running = 0, [], set(workers)

    def pull(w):
        mark = version if version < updates else -1
        comm.send(torch.cat([theta, theta.new_tensor([mark])]), w)
        if mark == -1:
            running.discard(w)

    for w in workers:
        pull(w)
    g = torch.empty_like(theta)
    while running:
        w = comm.recv(g, None)
        if version == updates:
            pull(w)
            continue
        counted.append((w, g.clone()))  # no look at what it was computed on
        if len(counted) < take:
            continue
        adam_step(theta, torch.stack([c for _, c in counted]).mean(dim=0), m, v, version + 1, lr)
        version += 1
        for u, _ in counted:
            pull(u)
        counted = []
    return theta
