"""The OpenAI-compatible Ray Serve ingress: HTTP, validation, chat template, engine replicas, responses."""
