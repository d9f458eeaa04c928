"""The rollout pipeline (`rollout.py`): generation and training joined by one bounded buffer, the staleness bound
and dropping, dynamic sampling, the timeline."""
