"""Continuous batching: which requests run in the next step, and how many tokens each."""
