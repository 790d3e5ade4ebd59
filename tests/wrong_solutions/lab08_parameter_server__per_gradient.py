# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: versions counted per gradient applied instead of per update: an update of n gradients moves
# the version n times, each gradient applied at its own. Right for an asynchronous server (one gradient an update);
# wrong for a synchronous one, whose N gradients of a step come out 0, 1, ..., N-1 instead of all 0.
# EXPECT FAIL: staleness

# ANSWER: staleness
def staleness(log):
    version, pulled, read, waiting, latest, taus = 0, {}, {}, [], {}, []
    for what, x in log:
        if what == "pull":
            pulled[x] = version
        elif what == "push":
            latest[x], read[len(taus)] = len(taus), pulled[x]
            waiting.append(len(taus))
            taus.append(None)
        elif what == "drop":
            waiting.remove(latest.pop(x))
        elif what == "update":
            for i in waiting[:x]:
                taus[i] = version - read[i]
                version += 1  # one version per gradient
            waiting = waiting[x:]
    return taus
