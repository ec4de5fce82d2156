"""The lowest layer: the Snapshot, the NVML and procfs readers, locks, units and the GPU
selection that the agent and the launcher share. Imports nothing else of the package."""
