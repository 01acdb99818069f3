"""fd across instances: the global scheduler on Redis (``global_scheduler``)."""
