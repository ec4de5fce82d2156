"""Simulated GPUs: a YAML scenario and a pynvml-shaped driver that plays it (``driver``)."""
