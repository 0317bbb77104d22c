"""Planner regret: the plan the calibrated planner picks against the best of a >= 30-plan sweep (issue 49 item 5)."""
