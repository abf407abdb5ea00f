"""Model code: parallel layers, Llama-family models, weight loading, the model runner and the sampler.

Never imports Ray: workers wrap this package; it only sees plain data and torch process groups.
"""
