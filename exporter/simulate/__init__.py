"""Simulated GPUs: a YAML scenario (``scenario``), the pynvml-shaped driver that plays it and is
handed to ``Nvml(library=...)`` (``driver``), and the scenario's real processes (``processes``)."""
