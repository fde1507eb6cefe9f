"""Harnesses shared by benchmarks and tests: real parts driven in-process or attacked on purpose.

Nothing here is used by a node; it exists so ``bench/*.py`` and ``tests/`` drive
the same code the same way instead of each keeping a private copy.
"""
