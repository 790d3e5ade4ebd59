"""Pipeline parallelism: the GPT's blocks cut into stages, micro-batches flowing through them on a schedule.

actions.py      the notation: Action (F, B, BI, BW of a micro-batch on a chunk) and Schedule (per rank, in order)
schedules.py    GPipe, 1F1B, interleaved 1F1B, ZB-H1; make_schedule(name); simulate, validate, bubble
schedules_v.py  the V schedules: ZB-V and DualPipeV (two stages per rank)
executor.py     the stages of the model and the executor that runs any schedule on real ranks
"""
