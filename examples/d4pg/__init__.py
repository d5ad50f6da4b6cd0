"""D4PG on hvrep: asynchronous actor processes feed each learner rank's replay; the learner is replicated.

The actor side (``actor``, ``actors``, ``replay``, ``policy``) never imports TensorFlow; ``agent`` (the
learner's networks and step) and ``train`` (the app) do. See docs/d4pg.md.
"""
