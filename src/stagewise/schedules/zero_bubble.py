"""Zero-bubble schedules."""
