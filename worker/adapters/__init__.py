"""The real things behind the ports: search backends, the embedder, the model."""
