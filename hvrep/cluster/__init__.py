"""Cluster tooling: launching under mpirun/horovodrun/Slurm, checking a machine (``hvrep launch``, ``doctor``)."""
