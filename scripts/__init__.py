"""The offline tools and benchmarks; each is run as ``python scripts/<name>.py``."""
