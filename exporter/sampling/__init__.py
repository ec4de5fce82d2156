"""Builds Snapshots (``collect``) and takes them on a schedule with a short history
(``sampler``). Imports only ``core``."""
