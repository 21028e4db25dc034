"""The operator's loop around the serving stack: the traffic audit (``ops.audit``,
``ops.audit_report``), the canary's run-time weight (``ops.canary``) and the old-versus-canary
verdict (``ops.compare``), all reading requests through ``ops.records`` (the request log on
Kafka, a dump of it, or a trace file). Above bench (it reuses its trace reading), below launch
(the command line)."""
