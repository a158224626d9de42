"""Read-only model analysis: inspect, FLOPs, fusion status, symbolic shapes."""
