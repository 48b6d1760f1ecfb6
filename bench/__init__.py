"""Benchmarks (not tests): each writes JSON and PNG plots under bench/results/ and prints a table.

`python -m bench` runs every benchmark; `python -m bench model` runs one (see bench/__main__.py).
"""
