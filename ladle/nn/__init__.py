"""Models and what runs them on a whole graph: the GNNs, layer-wise and target-node inference, scoring,
and checked loading of a run's saved weights."""
