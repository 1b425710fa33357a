"""Pictures drawn from real runs."""
