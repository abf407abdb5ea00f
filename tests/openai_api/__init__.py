"""OpenAI-API conformance of the pagedserve ingress: one app, deployed once for the whole package."""
