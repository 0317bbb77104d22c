"""The planner's predictions against runs of the plans (``python -m benchmarks.plan_accuracy``)."""
