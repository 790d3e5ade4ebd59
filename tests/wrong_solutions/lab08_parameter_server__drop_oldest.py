# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: a drop discards the worker's OLDEST waiting gradient, not the one received last. Every log in
# which a worker has at most one gradient waiting at a drop reads the same; the written log where worker 1 has two
# waiting tells them apart.
# EXPECT FAIL: staleness

# ANSWER: staleness
def staleness(log: list[tuple[str, int]]) -> list[int | None]:
    version, pulled, read, waiting, taus = 0, {}, {}, [], []
    for what, x in log:
        if what == "pull":
            pulled[x] = version
        elif what == "push":
            read[len(taus)] = (x, pulled[x])
            waiting.append(len(taus))
            taus.append(None)
        elif what == "drop":
            waiting.remove(next(i for i in waiting if read[i][0] == x))  # the oldest of x's
        elif what == "update":
            for i in waiting[:x]:
                taus[i] = version - read[i][1]
            waiting = waiting[x:]
            version += 1
    return taus
