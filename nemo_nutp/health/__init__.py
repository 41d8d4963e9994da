"""How failures are judged, light enough for every process (no torch, no megatron-core).

* ``decisions``: pure decisions (who is blamed, which GPUs are failed next, which job runs).
* ``commit``: the live re-layout's commit protocol: its invariants and pure rules (which step
  is committed, the next plan, old rank -> new rank).
* ``watch``: what ranks report (heartbeats, stack watcher, collective sequence numbers) and
  what the control side reads (health report, newest checkpoint, restart summaries).
* ``check``: the one failure check of a running world (exits, blame, hang, health), polled by
  the CPU supervisor and the live control loop.
* ``aggregate``: hang detection in O(1) per training rank: node watchdogs publish one digest
  per node, a job-level aggregator (its own process) decides over all ranks.

Used by the rank-side runtime (``train/``, ``live/``) and by the control processes
(``recovery/``) alike, so it sits below both.
"""
