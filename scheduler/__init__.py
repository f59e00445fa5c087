"""The scheduler: KV block accounting, admission, continuous batching and preemption (no I/O, no torch)."""
