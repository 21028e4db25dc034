"""The entry layer: the `tierflow` command line, the local stack of processes, the demo and
the stack benchmark, the Kafka broker launcher and stub generation.

The only code allowed to import every other part (the services, the worker, the benchmark
harness); nothing imports it, except the tests that start real processes.
"""
