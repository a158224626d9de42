"""Rewrite passes, one per module (installed as ``graphopt.rewrites``).

Every module calls ``graphopt.registry.register`` once; ``registry.load_builtin_passes`` imports
them all. Tests live beside each module as ``<name>_test.py``.
"""
