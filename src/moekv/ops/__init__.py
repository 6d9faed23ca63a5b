"""Kernel dispatch: every op has a pure-PyTorch reference (ops.reference) and, where written, a
Triton implementation (ops.triton) with the same signature. `ops.dispatch` picks one."""
