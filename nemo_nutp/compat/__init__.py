"""Platform compatibility shims (see :mod:`nemo_nutp.compat.cpu`).

Nothing is imported here: ``nemo_nutp`` imports ``common.quiet`` first thing, before torch."""
