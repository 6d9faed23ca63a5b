"""The package version (a leaf module: the server's /version reads it without importing the package API)."""

__version__ = "0.1.0"
