"""Demos and figures the lesson notebooks use; each scheme itself lives in parlab/<scheme>.py."""
