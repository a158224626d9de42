"""Feeds (folders, generation, probing), metrics and budgets, reference output storage."""
