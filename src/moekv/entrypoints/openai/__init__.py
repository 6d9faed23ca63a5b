"""The OpenAI-compatible HTTP server: protocol.py (wire format), serving*.py (endpoint logic),
server.py (the FastAPI app), cli.py (`moekv serve`)."""
