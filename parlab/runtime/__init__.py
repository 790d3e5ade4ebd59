"""The machinery that runs ranks, apart from the algorithms: the rank server and the parent's handle on it, what
runs inside each forked rank, the hang diagnosis, the progress line, scratch folders and the lessons' widgets.

`parlab.launch` is the one entry point (`parlab.launch(fn, world_size)`); a student reads the scheme files at the
top of the package and need not read this folder.
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
