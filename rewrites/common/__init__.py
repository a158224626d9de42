"""What several passes share: FFN discovery, activation statistics, budget arithmetic."""
