"""The pipeline steps a user runs; each is run as ``python scripts/<name>.py``."""
