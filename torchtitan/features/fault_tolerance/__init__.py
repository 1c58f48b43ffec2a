"""Fault tolerance across replica groups with torchft: groups that fail and rejoin while the others train.

A *replica group* is one ordinary launch (one or more ranks, possibly sharded inside with FSDP/TP/PP); the
groups are the replicate dimension of HSDP, joined by torchft's lighthouse, which forms a quorum of the live
groups. In the synchronous mode each step averages the gradients across the quorum and commits only if every
group agrees; a group that dies costs the others one discarded step, and a restarted group heals from a live
one (weights, optimizer, lr schedule, step, data position). The semi-synchronous modes (LocalSGD, DiLoCo)
synchronize every ``sync_steps`` instead. docs/fault_tolerance.md is the user's guide.

Modules: ``checks`` (the pre-launch check, light), ``errors`` (the one-line failures), ``lighthouse``
(starting and reaching it), ``manager`` (the torchft Manager of one rank), ``positions`` (every group's data
position), ``heal`` (what a healing group receives), ``replicas`` (the trainer's seam: quorum, averaging,
commit), ``semi_sync`` (LocalSGD / DiLoCo). torchft is imported only when fault tolerance is on.
"""
