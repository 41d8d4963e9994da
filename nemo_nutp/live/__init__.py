"""The rank side of a live re-layout (``recovery.mode=live``): survivors keep their processes.

* ``manager``: ``LiveManager``, the one object the training loop calls (vote before every
  update, stop and re-layout on a failure or at a step boundary, join as a returning GPU).
* ``link``: ``LiveRank``, this rank's connection to the control process (reports, decisions,
  the abort watch, the per-step vote).
* ``backend``: the one place that knows gloo from NCCL: abortable waits, abandoning a world,
  joining the next.

The control process's side is ``recovery/control.py``; the protocol's rules are
``health/commit.py``; faults injected at a phase of a step (tests, demos) are
``common/faults.py``'s, fired through ``LiveRank.injector``.
"""
