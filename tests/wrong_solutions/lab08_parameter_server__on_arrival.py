# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The bug: a gradient's v is taken when it arrives (the version then), not when the update that applies
# it comes. Right for lesson 08's servers, whose next update applies every gradient received since the last; wrong
# for a server that applies at most 2 an update, where a gradient can wait through an update; and a dropped gradient
# gets a number instead of None.
# EXPECT FAIL: staleness

# ANSWER: staleness
def staleness(log):
    version, pulled, taus = 0, {}, []
    for what, x in log:
        if what == "pull":
            pulled[x] = version
        elif what == "push":
            taus.append(version - pulled[x])
        elif what == "update":
            version += 1
    return taus
