"""kvcached inside inference engines (``kvcached.integrations.vllm``)."""
