"""The ``graphopt`` command line: one module per command; ``main`` wires them."""
