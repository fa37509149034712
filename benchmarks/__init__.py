"""Performance benchmarks of fedmeet (issue #7): training step, generation, communication, memory.

Run all of them with ``python -m benchmarks.run`` (``make bench``); results go to ``reports/bench/``.
"""
