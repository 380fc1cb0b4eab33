"""Tests of tracing: the timeline, the straggler report, the flight recorder (issue #28)."""
