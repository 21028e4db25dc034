"""Hop 2: Kafka. Each admitted request is written to its tier's topic; the tier topics are read
back in strict priority, offsets committed only when a request is finished."""
