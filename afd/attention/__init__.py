"""The attention role: attention + KV cache + router on this rank; the FFN half through the connector."""
