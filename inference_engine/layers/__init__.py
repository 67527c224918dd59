"""Building blocks of the model code: sharding-aware linear layers, norms, rotary embeddings, attention."""
