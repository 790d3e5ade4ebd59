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


# The same, as source for the scripts the tests run in a process of their own: children() of that process.
CHILDREN = (
    "import os\n\n" + inspect.getsource(children_of) + "\n\ndef children():\n    return children_of(os.getpid())\n"
)
