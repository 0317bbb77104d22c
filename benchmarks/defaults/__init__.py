"""Defaults that pay: every synchronous schedule with the default cut against its best named cut (issue 49 item 1)."""
