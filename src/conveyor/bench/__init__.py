"""Benchmarks behind ``conveyor bench``: each measures one thing and writes JSON."""
