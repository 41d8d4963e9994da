"""The light control processes (no torch, no megatron-core at import): they start, watch and
restart or re-lay out the training ranks; they never train.

* ``supervisor``: the single-machine supervisor of ``nutp-train recovery.enabled=true``.
* ``world``: one world's rank processes (fork server, preloaded modules, stop).
* ``control``: the live control loop (``recovery.mode=live``): aborts, decisions, new worlds.
* ``hosts``: where ranks run (this machine, or node agents on Slurm).
* ``agent``: a node agent (Slurm): starts and reaps this node's ranks, its node watchdog.

Rules and the watchdog's readers are ``health/``; the ranks' side is ``train/`` and ``live/``.
"""
