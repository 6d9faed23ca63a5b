"""Benchmarks run from the command line (`moekv bench ...`)."""
