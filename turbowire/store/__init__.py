"""turbowire.store: the store half, outside vLLM: chunk keys, LMCache tiers, the Redis directory.

Nothing here imports vLLM: the connector (inside an engine) and the proxy (outside) share it.
"""
