"""Held-out calibration: calibrate on the run of one plan, predict many others (issue 49 item 2)."""
