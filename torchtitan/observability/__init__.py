"""What a run tells: per-step metrics, MFU and FLOPs, the console, profiling, the run's records, logging."""
