"""The grader's bytecode cache (parlab/grading/grader.py): filled once before any student code runs; without a
sandbox each submission gets a copy of it, of the files as the warm-up wrote them and nothing else."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from parlab.grading import official
from parlab.grading.grader import Grader
from parlab.grading.isolation import Sandbox


@pytest.fixture(scope="module")
def unsandboxed():
    grader = Grader(official.load_labs(), timeout=20, sandbox=Sandbox("none"), guard=None)
    yield grader, grader.shared_pycache()
    grader.close()


def test_the_cache_holds_what_a_kernel_imports(unsandboxed):
    _, shared = unsandboxed
    for module in ("torch", "torch._dynamo", "ipykernel.kernelapp", "parlab.runtime.launcher"):
        source = importlib.util.find_spec(module).origin
        sys.pycache_prefix = str(shared)
        try:
            cached = importlib.util.cache_from_source(source)
        finally:
            sys.pycache_prefix = None
        with open(cached, "rb") as pyc:  # where Python itself looks under the prefix: a .pyc of this Python
            assert pyc.read(4) == importlib.util.MAGIC_NUMBER, (module, cached)


def test_a_submission_without_sandbox_never_receives_what_another_planted_in_the_shared_cache(unsandboxed, tmp_path):
    grader, shared = unsandboxed
    files = sorted(p for p in shared.rglob("*.pyc"))
    changed, kept = files[0], files[1]
    original = changed.read_bytes()
    planted = shared / "planted" / "evil.cpython-311.pyc"
    try:  # what a submission without a sandbox can do: the shared cache is a folder of this user's
        changed.write_bytes(original[:16] + b"tampered")
        planted.parent.mkdir()
        planted.write_bytes(b"evil")
        own = grader._own_pycache(tmp_path)
    finally:
        changed.write_bytes(original)
    copied = {str(p.relative_to(own)) for p in own.rglob("*.pyc")}
    assert str(changed.relative_to(shared)) not in copied  # compiled from its source where it is used instead
    assert "planted/evil.cpython-311.pyc" not in copied
    assert (own / kept.relative_to(shared)).read_bytes() == kept.read_bytes()
    assert len(copied) == len(files) - 1
