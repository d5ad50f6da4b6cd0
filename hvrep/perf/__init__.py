"""Performance tooling: benchmarks, run summaries, the α-β scaling model, reports (``hvrep bench``, ``report``)."""
