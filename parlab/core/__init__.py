"""What every scheme stands on. A scheme imports these and nothing above them (tests/test_layout.py).

comm.py       traced collectives: torch.distributed plus a record of every call (bytes, peers, times), and
              comm.device(), the device a rank's tensors live on (its GPU under NCCL, else the CPU)
trace.py      what the ranks did, as data: one Event per collective, send/recv or compute span
probe.py      a recorder of every call into torch.distributed at the lowest Python level (twins, lab checks)
check.py      one deterministic verdict line against the single-device reference
models.py     the reference GPT, its synthetic corpus and its single-device training
moe.py        the Mixture-of-Experts layer the GPT can use (one device: router, top-k, capacity, aux loss)
memory.py     bytes held, counted from the tensors a rank really holds
mesh.py       the device mesh: ranks on named axes, one process group per axis (torch's DeviceMesh)
hardware.py   named hardware profiles: the one model of time (paced runs and the planner)
pace.py       an emulated device and link, so that timelines show the schedule, not the CPU scheduler
scratch.py    scratch folders that are always removed (disk offload, checkpoints)
"""
