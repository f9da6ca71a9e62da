"""tailserve: a low-latency machine-learning serving system."""

__version__ = "0.1.0"
