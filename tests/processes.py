"""Helpers the launch tests share: which processes a process has started (read from /proc)."""

import inspect
import os


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def ranks_of(server_pid: int) -> list[int]:
    """The rank server's children less its spares (processes it prepared for the next launch, named parlab-spare,
    which exist between launches when spares are on: PARLAB_SPARES, parlab/launch.py)."""
    ranks = []
    for pid in children_of(server_pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "parlab-spare":
                    continue
        except OSError:  # gone meanwhile
            continue
        ranks.append(pid)
    return ranks


# The same, as source for the scripts the tests run in a process of their own: children() of that process.
CHILDREN = (
    "import os\n\n" + inspect.getsource(children_of) + "\n\ndef children():\n    return children_of(os.getpid())\n"
)
