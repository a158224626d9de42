"""Rewrite passes, one per module (installed as ``graphopt.rewrites``).

Every builtin module (``graphopt.registry.BUILTIN_MODULES``) calls ``graphopt.registry.register``
once; ``registry.builtin()`` imports them all or fails naming the module. Tests live beside each module as ``<name>_test.py``.
"""
