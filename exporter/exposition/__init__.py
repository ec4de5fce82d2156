"""Snapshot to Prometheus metric families and text (``metrics``)."""
