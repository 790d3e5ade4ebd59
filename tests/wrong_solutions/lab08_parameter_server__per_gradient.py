# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: versions counted per gradient received instead of per update applied, and a gradient's
# staleness taken when it arrives. Right for an asynchronous server (one update per gradient, applied at once);
# wrong for a synchronous one, whose N gradients of a step come out 0, 1, ..., N-1 instead of all 0.
# EXPECT FAIL: staleness

# ANSWER: staleness
def staleness(log):
    version, pulled, taus = 0, {}, []
    for what, w in log:
        if what == "pull":
            pulled[w] = version
        elif what == "push":
            taus.append(version - pulled[w])
            version += 1
    return taus
