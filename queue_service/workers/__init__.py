"""Hop 5: the worker control stream (``tierflow.v1.WorkerControl``), one per attached worker,
and the dispatcher's handle for each remote worker."""
