"""DualPipeV."""
