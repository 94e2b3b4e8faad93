"""Benchmark entry points (timing lives here, never in tests)."""
