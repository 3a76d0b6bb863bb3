"""The version of beatflow (a leaf module: what keys caches on it imports this, not the package)."""

__version__ = "0.1.0"
