"""tierflow: tiered LLM serving with layer-boundary prefill preemption (FlowPrefill).

This package holds what every service shares: configuration, logging set-up and the
``tierflow`` command line. The engine lives in ``worker``, the scheduler in ``queue_service``.
"""

__version__ = "0.1.0"
