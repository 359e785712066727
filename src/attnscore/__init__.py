"""attnscore."""
