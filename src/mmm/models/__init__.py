"""Plain single-device models; parallelism is applied from outside (mmm.parallel)."""
