"""Case builders shared by tests, benchmarks and tools (importable without the tests package).

attention_cases.py   full-precision and low-bit paged-attention cases (pages, metadata, staging)
bad_requests.py      malformed OpenAI requests (issue 20 cases, a seeded fuzzer) for server tests and the soak run
"""
