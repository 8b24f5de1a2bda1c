"""Telemetry: call spans (timeline), device samples and the hub that feeds the dashboard."""
