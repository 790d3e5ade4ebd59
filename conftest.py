"""pytest configuration shared by the tests and by nbval over the notebooks."""

import os

# OpenMP threads that wait for work spin (OMP_WAIT_POLICY=ACTIVE is libgomp's way when it sees no more threads than
# cores). The suite runs three workers on two cores (README), each with torch's two intra-op threads in its own
# process and in the kernels it starts: every spin burns a core another worker needs. Measured on eight files of
# in-process runs (-n 3): 137-152 s of CPU and 72-84 s of wall time spinning, 113-115 s and 59-62 s waiting
# passively. libgomp reads this when torch loads it: set here, before a test module imports torch; the processes the
# tests start (kernels, rank servers, command lines) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collectstart(collector):
    # nbval compares every output mime type of a notebook cell. Plotly figures (their JSON and HTML) carry
    # random ids and timing-dependent data: skip them here and test figure data in tests/ instead.
    if hasattr(collector, "skip_compare"):
        collector.skip_compare = tuple(collector.skip_compare) + (
            "application/vnd.plotly.v1+json",
            "text/html",
            "application/javascript",
            "stderr",
        )


# Deliberately wrong lab solutions live in tests/; the lab tests grade them explicitly, nbval must not collect them.
collect_ignore_glob = ["tests/wrong_solutions/*"]
