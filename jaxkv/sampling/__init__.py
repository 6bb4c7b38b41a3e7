"""Sampling: what a request asks for (params.py: SamplingParams, vLLM's fields), the sampler
programs that pick the next tokens on the device (sampler.py) and the rows they sample
(rows.py: last rows, draft rows, penalties, structured outputs' bitmasks), the runner's
RowSampler that dispatches them and reads the tokens back (row_sampler.py), and plain steps'
sampling fused into the step programs (fused_sampling.py).

Importing this package imports nothing else: SamplingParams (plain Python) loads without JAX.
"""
