"""``kvplane bench``: scenarios that time kvplane against the raw baseline in the same process.

Each scenario module registers its scenarios in ``kvplane.bench.scenarios``; the runner times, verifies,
prints a table and writes JSON and a plot. Results are ratios against the baseline, since shared machines
are noisy.
"""
