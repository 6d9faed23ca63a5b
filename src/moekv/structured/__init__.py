"""Structured outputs: grammar-constrained decoding with xgrammar (JSON schema, any JSON object, regex,
choice). `GrammarBackend` compiles a request's grammar and keeps one matcher per request; each step it
fills the packed token bitmask of the constrained rows, which the sampler applies on the device."""

from moekv.structured.backend import GrammarBackend, xgrammar_available

__all__ = ["GrammarBackend", "xgrammar_available"]
