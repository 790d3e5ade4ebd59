"""A restarted torchrun group meets in a namespace of its own in the agent's store
(parlab.runtime.launcher.init_from_env).

torchrun's agent shares its TCPStore with its workers and keeps it across restarts; the keys a process group
writes there (each gloo rank's address) are the same every attempt. Here the test process plays the agent (it
hosts the store and sets the environment torchrun sets): the ranks form a group and exit, then fresh processes form
it again as torchrun's restarts would, all but rank 0 arriving late. Without a namespace per attempt, rank 0 reads
the late ranks' addresses of the attempt before and fails to connect ("connectFullMesh failed ... Connection
refused") or hangs. (Which side of a gloo pair connects depends on its ports: a pair whose early side only waits
for the other still forms, so the test has three late peers and two restarts.)"""

import os
import signal
import subprocess
import sys

import torch.distributed as dist

RANK_CODE = r"""
import os, sys, time, traceback
import torch, torch.distributed as dist
from parlab.runtime.launcher import init_from_env
rank = int(os.environ["RANK"])


def attempt(number):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(number)  # what torchrun's agent sets in each attempt
    if number > 0 and rank > 0:
        time.sleep(1)  # rank 0 looks for the others' addresses before they have written this attempt's
    init_from_env("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == int(os.environ["WORLD_SIZE"]), total


# Each attempt in a fresh process, as torchrun restarts them: the sockets of the attempt before are closed.
for number in range(int(os.environ["TEST_ATTEMPTS"])):
    child = os.fork()
    if child == 0:
        try:
            attempt(number)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)  # without tearing the group down: the keys it wrote stay in the agent's store
    if os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) != 0:
        sys.exit(f"attempt {number} failed")
print("every attempt formed its group")
"""

WORLD, ATTEMPTS = 4, 3  # without the namespace, 6 of 6 runs failed (2 ranks and 5 attempts: 3 of 4)


def test_a_restarted_group_does_not_read_the_addresses_of_the_attempt_before():
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent_store.port), "WORLD_SIZE": str(WORLD),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "test", "PARLAB_WARM": "0",
           "OMP_NUM_THREADS": "1", "TEST_ATTEMPTS": str(ATTEMPTS)}  # fmt: skip
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_CODE],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # with the attempts it forks: all killed at the end, whatever happened
        )  # fmt: skip
        for r in range(WORLD)
    ]
    try:
        for rank, process in enumerate(ranks):
            out, err = process.communicate(timeout=45)
            assert process.returncode == 0 and "every attempt formed its group" in out, f"rank {rank}: {err[-2000:]}"
    finally:
        for process in ranks:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
