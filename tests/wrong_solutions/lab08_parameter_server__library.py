# ruff: noqa
# A wrong answer to labs/lab08_parameter_server.ipynb (tests/test_wrong_answers.py grades it; the other answers are the
# solution's). The cheat: the synchronous server is parlab's own (run_sync_server) wrapped round a lab model loaded
# with theta (issue 40: this passed). Its numbers and messages are right; the check names the library call.
# EXPECT FAIL: sync

# ANSWER: sync
def sync_server(theta, steps, lr):
    model = build_lab_model()
    ps.vector_to_params(theta, model)
    ps.run_sync_server(model, torch.optim.SGD(model.parameters(), lr=lr), steps)
    return ps.params_to_vector(model)
