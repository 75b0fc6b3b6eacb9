"""kvserve: an LLM serving engine built around one transparent, pluggable scheduler."""

__version__ = "0.1.0"
