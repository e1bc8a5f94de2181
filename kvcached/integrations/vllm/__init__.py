"""kvcached as a vLLM KV connector: ``kv_connector_module_path`` =
``kvcached.integrations.vllm``, ``kv_connector`` = ``KvcachedConnector``."""

from kvcached.integrations.vllm.connector import KvcachedConnector, KvcachedMetadata

__all__ = ["KvcachedConnector", "KvcachedMetadata"]
