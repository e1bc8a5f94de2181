"""A reference inference engine on kvcached: a small transformer over a paged, TP-split KV cache.

It shows the whole contract in use (allocate, wait, prefill from the cached
prefix, commit, extend, free) and proves that cache reuse changes nothing
but speed: logits with reuse are bitwise those of a full recompute.
"""

from kvcached.engine.model import DenseKV, Generation, ModelConfig, TinyTransformer
from kvcached.engine.runner import Engine, PagedKV, RequestResult

__all__ = ["ModelConfig", "TinyTransformer", "DenseKV", "Generation", "Engine", "PagedKV",
           "RequestResult"]
