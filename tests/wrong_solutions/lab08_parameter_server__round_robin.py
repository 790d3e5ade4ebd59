# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The slip: the tensors dealt round-robin over the servers, as many tensors on each but not as many
# values (the lab model's tensors range from 32 values to 2,048): the busiest server holds 45% of the parameters.
# Training with it is right: only the placement check fails.
# EXPECT FAIL: placement

# ANSWER: placement
def placement(sizes, servers):
    return {name: i % servers for i, name in enumerate(sizes)}
