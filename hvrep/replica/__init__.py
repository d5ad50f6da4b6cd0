"""The replica layer: the Replicator, its collectives, communication settings and the backends that run them."""
