"""The loop: pipeline, pass registry, recipes, verification, report, provenance."""
