"""Quality evaluation of KV codecs on a real model: the P/D handoff scenario.

The prompt's KV (every layer, post-RoPE K as the cache holds it, bf16) goes through a codec; the
continuation is computed against that KV and compared with the exact run (KL, top-1, perplexity).
"""
