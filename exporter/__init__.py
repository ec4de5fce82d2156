"""gpu-exporter: one NVML sample per interval, read by an exporter, actions and a launcher."""

__version__ = "0.1.0"
