"""Tools around the cache: the demo, the synthetic chat workload, trace replay."""
