# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The cheat: the backup-worker server receives through parlab's own parameter server, lesson 08's
# any-source receive (ps.recv_from_any, the asynchronous server's helper), and averages with the library's
# vector helpers' help. Its numbers and messages are right; the check names the library calls.
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
        w = ps.recv_from_any(g)  # the library's any-source receive
        if sent[w] != version or version == updates:
            pull(w)
            continue
        counted.append((w, g.clone()))
        if len(counted) < take:
            continue
        adam_step(theta, torch.stack([c for _, c in counted]).mean(dim=0), m, v, version + 1, lr)
        version += 1
        for u, _ in counted:
            pull(u)
        counted = []
    return theta
