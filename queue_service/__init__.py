"""The queue service: admits requests, orders them by tier and deadline, drives the workers.

``queue_service.scheduler`` is the decision logic, a pure state machine (events in, commands
out, the clock passed in) so that the same code runs in-process in benchmarks and behind the
gRPC/Kafka I/O of the service. I/O lives in its own modules, never inside the decisions.
"""
