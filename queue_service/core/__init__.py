"""Hop 3: the service core. Deliveries from Kafka become scheduler events; the dispatcher
carries the scheduler's commands to the workers; worker reports go back to client streams."""
