"""Running rank code on real processes, apart from the algorithms.

    launcher.py    parlab.launch(fn, world_size): the one entry point, and init_from_env() under torchrun
    server.py      the rank server, seen from the parent: one process that imported torch once
    rankserver.py  the rank server itself, and workers.py its processes: each rank forked on demand
    rank.py        what runs inside each forked rank: seed, set up torch.distributed, run fn, report back
    events.py      the rank side of a live timeline: a rank's events streamed to the parent
    hang.py        why a launch did not finish: calls that can never match, a rank's death explained
    errors.py      what a launch raises and returns (RankError, LaunchTimeout, Results)
    progress.py    the progress bar or line a launch shows
    lazy_imports.py  one third-party import deferred to its first use (1.5 s of CPU in every kernel)

A student reads parlab/schemes and need not read this folder.
"""

import os

DEFAULT_TIMEOUT = 120.0  # seconds; long enough for any lesson at world size 8 on 2 CPU cores
SERVER_START_TIMEOUT = 300.0  # seconds for the rank server to import torch (slow disks, busy machines)
MISMATCH_SECONDS = 2.0  # how long ranks wait in calls that cannot match before launch stops them
CANCEL_WAIT = 10.0  # seconds for the server to stop a job's ranks; longer means it is stuck: it is replaced
RENDEZVOUS_PREFIX = "parlab-rendezvous-"  # rendezvous files in the temp folder: this + "<server pid>-<job id>"
SLOT_BYTES = 4096  # shared memory per rank for the call it is in (JSON; a group of ~500 ranks still fits)


def under_torchrun() -> bool:
    """True in a process started by torchrun (and not by parlab.launch)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "PARLAB_LAUNCHED" not in os.environ)
