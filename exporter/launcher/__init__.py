"""Launcher side: pick GPUs, lock them and bind a job to them.

``select_devices`` and ``reserve`` are the Python API; ``gpu-exporter recommend`` and
``gpu-exporter run`` the command line.
"""
