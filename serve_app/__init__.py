"""The OpenAI-compatible Ray Serve ingress (arrives with the serving issue)."""
