"""Online serving: the front end over replicas, the OpenAI-compatible HTTP server, its metrics."""
