"""Quality evaluations: `moekv eval kv` (KV cache fidelity, kv_fidelity.py)."""
