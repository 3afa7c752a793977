"""Benchmarks: each builds its own synthetic data, runs a baseline and this project's way in one
process and prints the ratio; run as ``python benchmarks/<name>.py``. Not part of the pipeline."""
