"""The benchmarks behind ``python -m elasticd.bench recovery|agent|checkpoint|outage``."""
