"""Scheduled actions over the sampler's Snapshots: zombie reaper, thermal hotspots, recommend."""
