# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: a gradient's version r is taken from the worker's FIRST pull since its last push, not from
# its last pull. The two differ only when the server updates between a worker's two pulls: the written log "a worker
# pulls twice, with an update between, before it pushes" has one (issue 40: without it this answer passed).
# EXPECT FAIL: staleness

# ANSWER: staleness
def staleness(log):
    version, pulled, waiting, taus = 0, {}, [], []
    for what, w in log:
        if what == "pull":
            pulled.setdefault(w, version)  # kept until the worker pushes: its first pull
        elif what == "push":
            waiting.append((len(taus), pulled.pop(w)))
            taus.append(None)
        elif what == "update":
            for i, r in waiting:
                taus[i] = version - r
            waiting = []
            version += 1
    return taus
