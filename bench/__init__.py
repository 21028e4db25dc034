"""In-process measurement harnesses: the engine benchmark, the policy benchmark and calibration.

They drive the real engine (and the real scheduler) inside one process, so policies can be
compared side by side in one run, as ratios, on a noisy machine.
"""
