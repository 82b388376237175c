"""Graphs: datasets and their splits, the synthetic graph, partitions, sparse matrices, the views through
which an ingredient sees the graph (ladle's own samplers and PyG's), the inputs a model takes, shards and
the cache."""
