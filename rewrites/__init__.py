"""Rewrite passes, one per module (installed as ``graphopt.rewrites``).

Every builtin module (``graphopt.engine.registry.BUILTIN_MODULES``) calls ``graphopt.engine.registry.register``
once; ``registry.builtin()`` imports them all or fails naming the module. Tests live beside each module as ``<name>_test.py``.
"""
