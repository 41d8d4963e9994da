"""Recovery: restart a job at reduced TP when GPUs fail or hang, and at a fuller layout when
they come back.

* ``decisions``: pure decisions (who is blamed, which GPUs are failed next, which job runs);
  no processes, no torch.
* ``watch``: what ranks report (heartbeats, stack watcher, collective sequence numbers) and what
  the supervisor reads (health report, newest checkpoint).
* ``aggregate``: hang detection in O(1) per training rank: node watchdogs publish one digest
  per node, a job-level aggregator (its own process) decides over all ranks.
* ``supervisor``: the single-machine supervisor of ``nutp-train recovery.enabled=true``.
* ``elastic``: the same decisions per restart of ``torchrun``/``srun``/``ft_launcher``.
"""
