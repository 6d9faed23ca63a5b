"""User-facing entry points: the offline LLM API, the CLI commands and the OpenAI server."""
