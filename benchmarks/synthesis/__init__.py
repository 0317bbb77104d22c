"""Schedules that write themselves (issue 35): the synthesizer against the hand-written schedules, on a suite
of cost models, with its lower bound and its time; ``python -m benchmarks.synthesis --help``."""
