"""The OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``): one small asynchronous service behind Envoy that translates each request into a
``tierflow.v1.Tierflow/Generate`` call to the queue service and its events back into OpenAI's
responses. It adds no scheduling: the tier comes from the gateway's header (a request's
``service_tier`` may only lower it) and everything else is the queue service's.
"""
