"""Failures and checkpoints.

checkpoint.py   sharded checkpoints: each rank saves what it holds, a metadata file says who held what, and a
                checkpoint loads resharded on another world size or mesh
failures.py     a rank that dies mid-step, training that resumes from the last checkpoint on the survivors, an
                asynchronous server that carries on without a dead worker; the arithmetic of MTBF and Young
"""
