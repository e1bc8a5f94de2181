"""Memory shared across processes: KV planes (shm, CUDA IPC), host pools, run directories."""
