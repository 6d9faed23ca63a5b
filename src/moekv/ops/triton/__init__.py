"""Triton implementations of moekv's ops; each mirrors the signature of its twin in ops.reference."""
