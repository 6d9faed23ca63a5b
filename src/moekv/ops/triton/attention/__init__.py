"""Paged attention over full-precision pages: decode (split-K), prefill, and the split combine."""
