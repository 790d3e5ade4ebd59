"""pytest configuration shared by the tests and by nbval over the notebooks."""


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
