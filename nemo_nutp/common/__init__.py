"""Helpers every floor uses: the ``NUTP_*`` environment variable names (``env``), the console,
free ports, the event log, the plan report, the output lock and helper processes that die with
their rank. Light: no torch, no megatron-core, nothing above ``layout/`` imported."""
