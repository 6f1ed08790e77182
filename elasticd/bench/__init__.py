"""The benchmarks behind ``python -m elasticd.bench recovery|agent|checkpoint|outage`` (the command
line is ``__main__``'s, the shared job and record helpers ``common``'s). Nothing in the library
imports it."""
