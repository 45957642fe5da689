"""E31 Batch data plane: GPU-pinned workers that run jobs (needs torch only inside jobs)."""
