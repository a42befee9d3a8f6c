"""Verification: the test harness (conformance, accuracy, load, metrics) and the container it runs against."""
