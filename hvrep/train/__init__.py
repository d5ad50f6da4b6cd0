"""The training app (``hvrep train``): run config, loop controller, steps, metrics, checkpoints, preemption."""
