"""beatflow: long ECG recordings to a list of abnormal heartbeats."""

__version__ = "0.1.0"
