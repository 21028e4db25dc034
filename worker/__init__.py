"""The GPU worker: the preemptible prefill engine and the process that attaches to the queue
service."""
