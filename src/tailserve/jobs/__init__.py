"""Batch jobs beside the serving path: precompute (score known inputs into Redis) and warm
(replay a recorded trace's most frequent requests against a worker)."""
