# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: a gradient's version r is taken from the worker's FIRST pull since its last push, not from
# its last pull. The two differ only when the server updates between a worker's two pulls: the written log "a worker
# pulls twice, with an update between, before it pushes" has one (issue 40: without it this answer passed).
# EXPECT FAIL: staleness

# ANSWER: staleness
def staleness(log):
    version, pulled, read, waiting, latest, taus = 0, {}, {}, [], {}, []
    for what, x in log:
        if what == "pull":
            pulled.setdefault(x, version)  # kept until the worker pushes: its first pull
        elif what == "push":
            latest[x], read[len(taus)] = len(taus), pulled.pop(x)
            waiting.append(len(taus))
            taus.append(None)
        elif what == "drop":
            waiting.remove(latest.pop(x))
        elif what == "update":
            for i in waiting[:x]:
                taus[i] = version - read[i]
            waiting = waiting[x:]
            version += 1
    return taus
