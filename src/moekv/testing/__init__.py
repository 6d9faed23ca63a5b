"""Case builders shared by tests, benchmarks and tools (importable without the tests package).

attention_cases.py   full-precision and low-bit paged-attention cases (pages, metadata, staging)
"""
